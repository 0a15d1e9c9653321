//! The paths of one project kept as a pinned base plus a patch series.
//!
//! Every module takes its paths from a [`Project`]; none joins a layout path onto the root itself.
//! The defaults are the layout this toolchain was built for (the live tree in `engine/upstream/`,
//! the registry in `upstream-sync/`); a project with another layout sets the fields.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

/// Where a project's files live. `root` anchors every relative path.
#[derive(Clone, Debug)]
pub struct Project {
    pub root: PathBuf,
    /// The live tree that `apply-chain` writes (base + patches), relative to `root`.
    pub live: PathBuf,
    /// Where pristine bases are cached (unpacked read-only, never modified); shared between projects.
    pub cache_dir: PathBuf,
}

impl Project {
    /// A project at `root` with the default layout and cache ([`default_cache_dir`]).
    pub fn new(root: impl Into<PathBuf>) -> Project {
        Project { root: root.into(), live: PathBuf::from("engine/upstream"), cache_dir: default_cache_dir() }
    }
    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> Project {
        self.cache_dir = dir.into();
        self
    }
    pub fn registry_path(&self) -> PathBuf {
        self.root.join("upstream-sync/UPSTREAM_SYNC.toml")
    }
    pub fn pristine_manifest_path(&self) -> PathBuf {
        self.root.join("upstream-sync/manifest.pristine")
    }
    pub fn patched_manifest_path(&self) -> PathBuf {
        self.root.join("upstream-sync/manifest.patched")
    }
    pub fn patches_dir(&self) -> PathBuf {
        self.root.join("patches")
    }
    /// The live tree (`engine/upstream/` by default).
    pub fn upstream_dir(&self) -> PathBuf {
        self.root.join(&self.live)
    }
    /// Backups of the live tree: `.backups/` beside it (`engine/.backups/` by default).
    pub fn backups_dir(&self) -> PathBuf {
        self.root.join(self.live.parent().unwrap_or(Path::new(""))).join(".backups")
    }
    pub fn sync_doc_path(&self) -> PathBuf {
        self.root.join("docs/UPSTREAM_SYNC.md")
    }
    /// Where a running rebase keeps its state (git-ignored).
    pub fn rebase_dir(&self) -> PathBuf {
        self.root.join(".tine-rebase")
    }
    /// Where a completed rebase writes its report (`<from>-to-<onto>.{md,json}`).
    pub fn bumps_dir(&self) -> PathBuf {
        self.root.join("docs/bumps")
    }
    pub fn rel<'a>(&self, p: &'a Path) -> Cow<'a, str> {
        p.strip_prefix(&self.root).unwrap_or(p).to_string_lossy()
    }
}

/// The cache of a project that names none: `$XDG_CACHE_HOME/patchchain`, else `~/.cache/patchchain`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("patchchain");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("patchchain")
}

impl Project {
    /// The live tree as messages name it: its path from the root, with a trailing `/`
    /// (`engine/upstream/` by default).
    pub fn live_name(&self) -> String {
        format!("{}/", self.live.display())
    }
}
