//! Integration tests of tine-engine.
