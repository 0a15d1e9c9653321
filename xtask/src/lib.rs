//! Tine's chain toolchain as a library: the `xtask` binary is a thin CLI over these modules,
//! and the integration tests drive them on synthetic projects.
//!
//! Data flows one way: [`base`] gives the pristine [`tree::Tree`], [`patch`] parses the series,
//! [`apply`] places it strictly, [`chain`] materialises `engine/upstream/`, [`verify`] proves it,
//! [`export`] turns an edited tree back into a patch.

pub mod apply;
pub mod base;
pub mod base85;
pub mod bump;
pub mod chain;
pub mod commands;
pub mod delta;
pub mod export;
pub mod gate;
pub mod import;
pub mod merge3;
pub mod model;
pub mod patch;
pub mod rebase;
pub mod registry;
pub mod sync_check;
pub mod tree;
pub mod verify;
