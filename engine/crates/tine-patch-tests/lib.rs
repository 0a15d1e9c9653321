//! No library: the tests are the patches' own files under engine/upstream/<crate>/tests/.
