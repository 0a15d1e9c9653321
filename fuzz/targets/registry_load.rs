//! The `UPSTREAM_SYNC.toml` registry parser on any bytes: an error, never a panic.
//!
//! The registry claims one canonical layout (`registry::render`, which every tool that edits the
//! registry writes): what loads must render, load back to the same registry, and render to the
//! same text again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use patchchain::registry;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(reg) = registry::parse(text) else { return };
    let rendered = registry::render(&reg);
    let again = registry::parse(&rendered).unwrap_or_else(|e| panic!("the canonical rendering does not load: {e}\n{rendered}"));
    assert_eq!(reg, again, "the canonical rendering loads as a different registry");
    assert_eq!(rendered, registry::render(&again), "rendering is not idempotent");
    let _ = registry::render_markdown(&reg);
    let _ = registry::lint(&reg, &|_, _, _| Ok(()), &[]);
});
