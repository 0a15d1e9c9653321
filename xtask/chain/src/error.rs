//! Showing a typed error with its causes.

use std::fmt;

/// An error and its chain of sources, `outer: cause: cause`, as `anyhow` shows `{:#}`: for
/// messages that embed an error (a verify step's reason, a refusal).
pub struct Causes<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Causes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}
