//! The pristine base: obtained, checked and cached, never modified.
//!
//! Three kinds: `crates` (`.crate` files obtained through cargo itself, so mirrors and offline
//! caches work, checked against their pinned sha256 and unpacked read-only into the user cache),
//! `dir` (a local directory) and `git` (a commit of a repository, read straight from its objects).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use crate::registry::{Base, CratePin};
use crate::tree::{self, Entry, ReadTreeError, Tree, MODE_EXEC, MODE_FILE};

/// Why the pristine base cannot be obtained. System errors carry what was being done.
#[derive(Debug, thiserror::Error)]
pub enum BaseError {
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    BareIo(#[from] std::io::Error),
    #[error("{context}")]
    ReadTree {
        context: String,
        #[source]
        source: ReadTreeError,
    },
    #[error("{context}")]
    Toml {
        context: String,
        #[source]
        source: toml::de::Error,
    },
    #[error("{context}")]
    Git {
        context: String,
        #[source]
        source: git2::Error,
    },
    #[error(transparent)]
    BareGit(#[from] git2::Error),
    #[error("cargo fetch succeeded but no {}-{}.crate with sha256 {} is in {}", .pin.name, .pin.version, .pin.sha256, .cargo_cache.display())]
    NotInCargoCache { pin: CratePin, cargo_cache: PathBuf },
    #[error("no {}-{}.crate with sha256 {} after cargo fetch", .pin.name, .pin.version, .pin.sha256)]
    StillMissing { pin: CratePin },
    #[error("`cargo fetch` for the base crates failed ({0}); see its output above")]
    FetchFailed(ExitStatus),
    #[error("{}-{}: the registry's checksum is {found:?}, the pin says {}; the pin or the registry is wrong", .pin.name, .pin.version, .pin.sha256)]
    ChecksumDiffers { pin: CratePin, found: Option<String> },
    #[error("{name}-{version}: cargo's lock file has no checksum for it (is it published?)")]
    NoChecksum { name: String, version: String },
    #[error("cargo fetched {}-{} but no .crate with sha256 {} is in {}", .pin.name, .pin.version, .pin.sha256, .cargo_cache.display())]
    FetchedOtherBytes { pin: CratePin, cargo_cache: PathBuf },
    #[error("cargo resolved no version of {0}")]
    NoVersion(String),
    #[error("`cargo {verb}` for {deps} failed ({status}):\n{stderr}")]
    CargoFailed { verb: String, deps: String, status: ExitStatus, stderr: String },
    #[error("{}: sha256 is {found}, the pin says {}", .file.display(), .pin.sha256)]
    CrateChecksum { file: PathBuf, pin: CratePin, found: String },
    #[error("{}: entry {entry:?} lies outside {prefix}", .file.display())]
    OutsidePrefix { file: PathBuf, entry: String, prefix: String },
    #[error("{}: unsafe path {entry:?}", .file.display())]
    UnsafePath { file: PathBuf, entry: String },
    #[error("repository path is not UTF-8")]
    NonUtf8Repository(PathBuf),
    #[error("`git fetch {url}` failed ({status})")]
    GitFetchFailed { url: String, status: ExitStatus },
    #[error("{path}: git mode {mode:o} (symlink or submodule) is not supported in a base")]
    UnsupportedMode { path: String, mode: i32 },
    #[error("{0}: submodules are not supported in a base")]
    Submodule(String),
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> BaseError {
    let context = context.into();
    move |source| BaseError::Io { context, source }
}

fn toml_err(context: &str) -> impl FnOnce(toml::de::Error) -> BaseError + '_ {
    move |source| BaseError::Toml { context: context.to_owned(), source }
}

fn git(context: impl Into<String>) -> impl FnOnce(git2::Error) -> BaseError {
    let context = context.into();
    move |source| BaseError::Git { context, source }
}

fn cargo_home() -> PathBuf {
    if let Some(d) = std::env::var_os("CARGO_HOME") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cargo")
}

pub fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Loads the pristine tree described by `base`; `project_root` anchors relative paths, `cache`
/// holds unpacked crates and fetched repositories.
pub fn load(base: &Base, project_root: &Path, cache: &Path, progress: &indicatif::ProgressBar) -> Result<Tree, BaseError> {
    match base {
        Base::Crates { crates } => load_crates(crates, cache, progress),
        Base::Dir { path } => {
            let dir = project_root.join(path);
            tree::read_tree(&dir).map_err(|source| BaseError::ReadTree { context: format!("reading the base directory {}", dir.display()), source })
        }
        Base::Git { url, commit, include } => load_git(url, commit, include, project_root, cache),
    }
}

fn load_crates(crates: &[CratePin], cache: &Path, progress: &indicatif::ProgressBar) -> Result<Tree, BaseError> {
    let mut tree = Tree::new();
    let mut fetched = false;
    for pin in crates {
        let dir = cache.join("base").join("crates").join(format!("{}-{}-{}", pin.name, pin.version, &pin.sha256[..16]));
        if !dir.join(".complete").exists() {
            let crate_file = match find_crate_file(pin)? {
                Some(f) => f,
                None if !fetched => {
                    fetched = true;
                    progress.set_message("fetching the base crates through cargo");
                    fetch_with_cargo(crates, cache)?;
                    find_crate_file(pin)?.ok_or_else(|| BaseError::NotInCargoCache { pin: pin.clone(), cargo_cache: cargo_home().join("registry/cache") })?
                }
                None => return Err(BaseError::StillMissing { pin: pin.clone() }),
            };
            progress.set_message(format!("unpacking {}-{}", pin.name, pin.version));
            unpack_crate(&crate_file, pin, &dir)?;
        }
        let sub = tree::read_tree(&dir).map_err(|source| BaseError::ReadTree { context: format!("reading the cached base {}", dir.display()), source })?;
        for (path, entry) in sub {
            if path == ".complete" {
                continue;
            }
            tree.insert(format!("{}/{}", pin.name, path), entry);
        }
    }
    Ok(tree)
}

/// The `.crate` in cargo's download cache whose sha256 equals the pin.
fn find_crate_file(pin: &CratePin) -> Result<Option<PathBuf>, BaseError> {
    let cache = cargo_home().join("registry").join("cache");
    let Ok(indexes) = fs::read_dir(&cache) else {
        return Ok(None);
    };
    for index in indexes {
        let candidate = index?.path().join(format!("{}-{}.crate", pin.name, pin.version));
        if let Ok(bytes) = fs::read(&candidate) {
            if tree::sha256_hex(&bytes) == pin.sha256 {
                return Ok(Some(candidate));
            }
        }
    }
    Ok(None)
}

/// Lets cargo download the pinned crates (honouring source replacement, mirrors and offline
/// settings) through a throw-away manifest, then checks Cargo.lock's checksums against the pins.
fn fetch_with_cargo(crates: &[CratePin], cache: &Path) -> Result<(), BaseError> {
    let dir = cache.join("fetch");
    fs::create_dir_all(dir.join("src")).map_err(io(format!("creating {}", dir.display())))?;
    let mut manifest = String::from("[package]\nname = \"patchchain-base-fetch\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n[workspace]\n\n[dependencies]\n");
    for c in crates {
        manifest.push_str(&format!("{} = \"={}\"\n", c.name, c.version));
    }
    fs::write(dir.join("Cargo.toml"), manifest)?;
    fs::write(dir.join("src/lib.rs"), "")?;
    let status = Command::new(cargo_bin()).arg("fetch").current_dir(&dir).status().map_err(io("running `cargo fetch`"))?;
    if !status.success() {
        return Err(BaseError::FetchFailed(status));
    }
    let lock = fs::read_to_string(dir.join("Cargo.lock")).map_err(io("reading the fetch Cargo.lock"))?;
    let lock: toml::Value = toml::from_str(&lock).map_err(toml_err("parsing the fetch Cargo.lock"))?;
    for c in crates {
        let found = lock
            .get("package")
            .and_then(|p| p.as_array())
            .into_iter()
            .flatten()
            .find(|p| p.get("name").and_then(|n| n.as_str()) == Some(c.name.as_str()) && p.get("version").and_then(|v| v.as_str()) == Some(c.version.as_str()));
        let checksum = found.and_then(|p| p.get("checksum")).and_then(|s| s.as_str());
        if checksum != Some(c.sha256.as_str()) {
            return Err(BaseError::ChecksumDiffers { pin: c.clone(), found: checksum.map(str::to_owned) });
        }
    }
    Ok(())
}

/// Pins for `names` at `version`: cargo downloads them (mirrors and offline caches work) and
/// its lock file gives each `.crate`'s sha256, which is then checked against the file itself.
pub fn resolve_crates(names: &[&str], version: &str, cache: &Path, progress: &indicatif::ProgressBar) -> Result<Vec<CratePin>, BaseError> {
    progress.set_message(format!("fetching the base crates at {version} through cargo"));
    let lock = lock_for(&names.iter().map(|n| (*n, format!("={version}"))).collect::<Vec<_>>(), "fetch", cache)?;
    let mut pins = Vec::new();
    for name in names {
        let checksum = locked(&lock, name, Some(version)).and_then(|p| p.get("checksum")).and_then(|s| s.as_str()).map(str::to_owned);
        let Some(sha256) = checksum else { return Err(BaseError::NoChecksum { name: (*name).to_owned(), version: version.to_owned() }) };
        let pin = CratePin { name: (*name).to_owned(), version: version.to_owned(), sha256 };
        if find_crate_file(&pin)?.is_none() {
            return Err(BaseError::FetchedOtherBytes { pin, cargo_cache: cargo_home().join("registry/cache") });
        }
        pins.push(pin);
    }
    Ok(pins)
}

/// The newest published (non-prerelease) version of `name`, as cargo resolves `*`.
pub fn newest_version(name: &str, cache: &Path) -> Result<String, BaseError> {
    let lock = lock_for(&[(name, "*".to_owned())], "generate-lockfile", cache)?;
    locked(&lock, name, None).and_then(|p| p.get("version")).and_then(|v| v.as_str()).map(str::to_owned).ok_or_else(|| BaseError::NoVersion(name.to_owned()))
}

fn locked<'a>(lock: &'a toml::Value, name: &str, version: Option<&str>) -> Option<&'a toml::Value> {
    lock.get("package")
        .and_then(|p| p.as_array())?
        .iter()
        .find(|p| p.get("name").and_then(|n| n.as_str()) == Some(name) && version.is_none_or(|v| p.get("version").and_then(|x| x.as_str()) == Some(v)))
}

/// Runs `cargo <verb>` on a throw-away manifest depending on `deps`; returns its lock file.
fn lock_for(deps: &[(&str, String)], verb: &str, cache: &Path) -> Result<toml::Value, BaseError> {
    let dir = cache.join(format!("resolve-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("src")).map_err(io(format!("creating {}", dir.display())))?;
    let mut manifest = String::from("[package]\nname = \"patchchain-base-resolve\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n[workspace]\n\n[dependencies]\n");
    for (n, req) in deps {
        manifest.push_str(&format!("{n} = \"{req}\"\n"));
    }
    fs::write(dir.join("Cargo.toml"), manifest)?;
    fs::write(dir.join("src/lib.rs"), "")?;
    let out = Command::new(cargo_bin()).args([verb, "--quiet"]).current_dir(&dir).output().map_err(io(format!("running `cargo {verb}`")))?;
    let lock = fs::read_to_string(dir.join("Cargo.lock"));
    let _ = fs::remove_dir_all(&dir);
    if !out.status.success() {
        return Err(BaseError::CargoFailed {
            verb: verb.to_owned(),
            deps: deps.iter().map(|(n, r)| format!("{n} {r}")).collect::<Vec<_>>().join(", "),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    toml::from_str(&lock.map_err(io("reading the resolve Cargo.lock"))?).map_err(toml_err("parsing the resolve Cargo.lock"))
}

fn unpack_crate(crate_file: &Path, pin: &CratePin, dest: &Path) -> Result<(), BaseError> {
    let bytes = fs::read(crate_file).map_err(io(format!("reading {}", crate_file.display())))?;
    let sha = tree::sha256_hex(&bytes);
    if sha != pin.sha256 {
        return Err(BaseError::CrateChecksum { file: crate_file.to_owned(), pin: pin.clone(), found: sha });
    }
    let prefix = format!("{}-{}/", pin.name, pin.version);
    let mut files = Tree::new();
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(&bytes[..]));
    for entry in archive.entries().map_err(io("reading the .crate archive"))? {
        let mut entry = entry.map_err(io("reading a .crate entry"))?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let path = entry.path()?.to_string_lossy().into_owned();
        let rel = path.strip_prefix(&prefix).ok_or_else(|| BaseError::OutsidePrefix { file: crate_file.to_owned(), entry: path.clone(), prefix: prefix.clone() })?.to_owned();
        if rel.split('/').any(|c| c == ".." || c.is_empty()) {
            return Err(BaseError::UnsafePath { file: crate_file.to_owned(), entry: path });
        }
        let mode = if entry.header().mode()? & 0o111 != 0 { MODE_EXEC } else { MODE_FILE };
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut data)?;
        files.insert(rel, Entry { mode, data });
    }
    // Unpack beside the destination, then rename: a half-unpacked cache never looks complete.
    let parent = dest.parent().expect("cache directories have parents");
    fs::create_dir_all(parent)?;
    let tmp = parent.join(format!(".unpack-{}-{}", pin.name, std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    for (rel, e) in &files {
        let p = tmp.join(rel);
        fs::create_dir_all(p.parent().expect("joined"))?;
        fs::write(&p, &e.data)?;
        // Read-only: the cache is never modified.
        fs::set_permissions(&p, fs::Permissions::from_mode(if e.mode == MODE_EXEC { 0o555 } else { 0o444 }))?;
    }
    fs::write(tmp.join(".complete"), format!("{} {}\n", pin.name, pin.sha256))?;
    if dest.exists() {
        make_writable(dest)?;
        fs::remove_dir_all(dest)?;
    }
    fs::rename(&tmp, dest).map_err(io(format!("moving the unpacked crate to {}", dest.display())))?;
    Ok(())
}

fn make_writable(dir: &Path) -> std::io::Result<()> {
    for e in fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            make_writable(&p)?;
        } else {
            fs::set_permissions(&p, fs::Permissions::from_mode(0o644))?;
        }
    }
    Ok(())
}

fn load_git(url: &str, commit: &str, include: &[String], project_root: &Path, cache: &Path) -> Result<Tree, BaseError> {
    let local = {
        let p = project_root.join(url);
        p.exists().then_some(p)
    };
    let key = &tree::sha256_hex(url.as_bytes())[..16];
    let cache = cache.join("base").join("git").join(format!("{key}.git"));
    let repo = match git2::Repository::open_bare(&cache) {
        Ok(r) => r,
        Err(_) => {
            fs::create_dir_all(&cache)?;
            git2::Repository::init_bare(&cache).map_err(git(format!("creating {}", cache.display())))?
        }
    };
    let oid = git2::Oid::from_str(commit).map_err(git(format!("bad commit id {commit:?}")))?;
    if repo.find_commit(oid).is_err() {
        let refspecs = ["+refs/heads/*:refs/remotes/base/*", "+refs/tags/*:refs/tags/*"];
        match &local {
            Some(path) => {
                let mut remote = repo.remote_anonymous(path.to_str().ok_or_else(|| BaseError::NonUtf8Repository(path.clone()))?)?;
                remote.fetch(&refspecs, None, None).map_err(git(format!("fetching {}", path.display())))?;
            }
            None => {
                // Remote URLs go through the git command line, which knows the user's credentials and proxies.
                let status = Command::new("git").arg("--git-dir").arg(&cache).args(["fetch", "--quiet", url]).args(refspecs).status().map_err(io("running `git fetch`"))?;
                if !status.success() {
                    return Err(BaseError::GitFetchFailed { url: url.to_owned(), status });
                }
            }
        }
    }
    let commit_obj = repo.find_commit(oid).map_err(git(format!("commit {commit} is not in {url}")))?;
    let mut out = Tree::new();
    let mut err = None;
    commit_obj.tree()?.walk(git2::TreeWalkMode::PreOrder, |dir, entry| {
        let path = format!("{dir}{}", entry.name().unwrap_or(""));
        if !include.is_empty() && !include.iter().any(|i| path == *i || path.starts_with(&format!("{i}/")) || i.starts_with(&format!("{path}/"))) {
            return git2::TreeWalkResult::Skip;
        }
        match entry.kind() {
            Some(git2::ObjectType::Tree) => git2::TreeWalkResult::Ok,
            Some(git2::ObjectType::Blob) => {
                let mode = match entry.filemode() {
                    0o100644 => MODE_FILE,
                    0o100755 => MODE_EXEC,
                    m => {
                        err = Some(BaseError::UnsupportedMode { path, mode: m });
                        return git2::TreeWalkResult::Abort;
                    }
                };
                match repo.find_blob(entry.id()) {
                    Ok(b) => {
                        out.insert(path, Entry { mode, data: b.content().to_vec() });
                        git2::TreeWalkResult::Ok
                    }
                    Err(e) => {
                        err = Some(e.into());
                        git2::TreeWalkResult::Abort
                    }
                }
            }
            _ => {
                err = Some(BaseError::Submodule(path));
                git2::TreeWalkResult::Abort
            }
        }
    })?;
    if let Some(e) = err {
        return Err(e);
    }
    Ok(out)
}
