//! Test support: named points where a command writes, at which the process can be made to die
//! as a kill -9 would (`std::process::abort()`: no destructors, no cleanup, no flush).
//!
//! - `TINE_CRASH_AT=<point>` aborts the first time the process reaches `<point>`;
//!   `TINE_CRASH_AT=<point>:<n>` the `n`-th time (points inside loops, such as one per file).
//! - `TINE_CRASH_TRACE=<file>` appends each point reached to `<file>`, one name a line, so a test
//!   can list the points a command passes through and crash it at every one of them.
//!
//! Without either variable a point costs one environment lookup. The points and what the
//! project holds at each are listed in `docs/evaluations/reliability-crash.md`.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The variable that names the point to die at.
pub const CRASH_AT: &str = "TINE_CRASH_AT";
/// The variable that names a file recording every point reached.
pub const TRACE: &str = "TINE_CRASH_TRACE";

static HITS: AtomicUsize = AtomicUsize::new(0);

/// Marks a point where the command has written something (or is about to).
pub fn crashpoint(name: &str) {
    if let Some(path) = std::env::var_os(TRACE) {
        use std::io::Write as _;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(f, "{name}");
        }
    }
    let Ok(want) = std::env::var(CRASH_AT) else {
        return;
    };
    let (point, nth) = match want.rsplit_once(':') {
        Some((p, n)) => match n.parse::<usize>() {
            Ok(n) => (p, n.max(1)),
            Err(_) => (want.as_str(), 1),
        },
        None => (want.as_str(), 1),
    };
    if point == name && HITS.fetch_add(1, Ordering::SeqCst) + 1 == nth {
        std::process::abort();
    }
}
