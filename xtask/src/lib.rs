//! Tine's porcelain over the generic [`patchchain`] library: the gate runner, the default model,
//! benchmarks, `up` and `ci`, the base-bump files of Tine's own, and the [`Tine`] extension.
//! The `xtask` binary (`main.rs`) parses the command line and dispatches to these and to
//! [`patchchain::commands`].

pub mod bump;
pub mod cmd;
pub mod gate;
pub mod model;
pub mod paths;
pub mod tine;

pub use paths::project;
pub use tine::Tine;
