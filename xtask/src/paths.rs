//! Where the project and Tine's cache are: the leaf every other module may read (it reads
//! none of them).

use std::path::PathBuf;

use patchchain::Project;

/// Where Tine caches bases and models: `$TINE_CACHE_DIR`, else `$XDG_CACHE_HOME/tine`, else `~/.cache/tine`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TINE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("tine");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("tine")
}

/// The project at `root`, with Tine's cache.
pub fn project_at(root: impl Into<PathBuf>) -> Project {
    Project::new(root).with_cache_dir(cache_dir())
}

/// The project this xtask belongs to: the parent of the `xtask/` package (`TINE_PROJECT_ROOT`
/// overrides, for tests).
pub fn project() -> Project {
    if let Some(r) = std::env::var_os("TINE_PROJECT_ROOT") {
        return project_at(r);
    }
    let manifest_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    project_at(manifest_dir.parent().expect("xtask/ lies inside the project root"))
}
