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
    #[error("{}: sha256 is {found}, the pin of {}-{} says {} (a truncated or corrupted download; cargo will not fetch it again while it is there): delete it and run again", .file.display(), .pin.name, .pin.version, .pin.sha256)]
    CorruptCrate { file: PathBuf, pin: Box<CratePin>, found: String },
    #[error("the cached base {} was modified since it was unpacked, and no pinned {}-{}.crate is at hand to unpack it again:\n{drift}\ndelete {} and run again (cargo fetches the crate)", .dir.display(), .pin.name, .pin.version, .dir.display())]
    CacheModified { dir: PathBuf, pin: Box<CratePin>, drift: String },
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
        let sub = match read_cached(&dir, pin)? {
            Cached::Good(t) => t,
            Cached::Unverified(t) => match find_crate_file(pin)? {
                // A cache unpacked before markers held manifests: checked against the .crate once.
                Found { file: Some(f), .. } => {
                    let files = crate_files(&f, pin)?;
                    if tree::manifest_of(&files) == tree::manifest_of(&t) {
                        tree::write_file_atomically(&dir.join(".complete"), marker(pin, &files).as_bytes())
                            .map_err(|e| BaseError::Io { context: format!("recording {}", dir.display()), source: e.source })?;
                    } else {
                        eprintln!("note: the cached base {} differs from {}; unpacking it again", dir.display(), f.display());
                        install(&files, pin, &dir)?;
                    }
                    files
                }
                // Only manifest.pristine can tell (every command checks it).
                _ => t,
            },
            Cached::Modified(drift) => match find_crate_file(pin)? {
                Found { file: Some(f), .. } => {
                    eprintln!("note: the cached base {} was modified since it was unpacked ({}); unpacking it again from {}", dir.display(), drift.replace('\n', ";"), f.display());
                    let files = crate_files(&f, pin)?;
                    install(&files, pin, &dir)?;
                    files
                }
                _ => return Err(BaseError::CacheModified { dir, pin: Box::new(pin.clone()), drift }),
            },
            Cached::Missing => {
                let crate_file = match find_crate_file(pin)? {
                    Found { file: Some(f), .. } => f,
                    Found { corrupt: Some((file, found)), .. } => return Err(BaseError::CorruptCrate { file, pin: Box::new(pin.clone()), found }),
                    Found { .. } if !fetched => {
                        fetched = true;
                        progress.set_message("fetching the base crates through cargo");
                        fetch_with_cargo(crates, cache)?;
                        match find_crate_file(pin)? {
                            Found { file: Some(f), .. } => f,
                            Found { corrupt: Some((file, found)), .. } => return Err(BaseError::CorruptCrate { file, pin: Box::new(pin.clone()), found }),
                            _ => return Err(BaseError::NotInCargoCache { pin: pin.clone(), cargo_cache: cargo_home().join("registry/cache") }),
                        }
                    }
                    Found { .. } => return Err(BaseError::StillMissing { pin: pin.clone() }),
                };
                progress.set_message(format!("unpacking {}-{}", pin.name, pin.version));
                let files = crate_files(&crate_file, pin)?;
                install(&files, pin, &dir)?;
                files
            }
        };
        for (path, entry) in sub {
            tree.insert(format!("{}/{}", pin.name, path), entry);
        }
    }
    Ok(tree)
}

/// What the cache holds for one pin.
enum Cached {
    /// Unpacked, and equal to the manifest recorded when it was unpacked from the pinned `.crate`.
    Good(Tree),
    /// Unpacked by an older version that recorded no manifest.
    Unverified(Tree),
    /// Unpacked, but changed since (the drift, described).
    Modified(String),
    /// Not (completely) unpacked.
    Missing,
}

/// The `.complete` marker: `name sha256`, then the manifest of the unpacked files.
fn marker(pin: &CratePin, files: &Tree) -> String {
    format!("{} {}\n{}", pin.name, pin.sha256, tree::render_manifest(&tree::manifest_of(files)))
}

/// The cached tree of `pin`, checked against the manifest its marker recorded: a cache that was
/// modified (a file edited, added, removed or its mode changed) is never used as it is.
pub fn check_cached(dir: &Path, pin: &CratePin) -> Result<Option<Result<Tree, String>>, BaseError> {
    Ok(match read_cached(dir, pin)? {
        Cached::Good(t) | Cached::Unverified(t) => Some(Ok(t)),
        Cached::Modified(d) => Some(Err(d)),
        Cached::Missing => None,
    })
}

fn read_cached(dir: &Path, pin: &CratePin) -> Result<Cached, BaseError> {
    let marker_path = dir.join(".complete");
    let Ok(text) = fs::read_to_string(&marker_path) else {
        return Ok(Cached::Missing);
    };
    let mut sub = tree::read_tree(dir).map_err(|source| BaseError::ReadTree { context: format!("reading the cached base {}", dir.display()), source })?;
    sub.remove(".complete");
    let (first, rest) = text.split_once('\n').unwrap_or((text.as_str(), ""));
    if first != format!("{} {}", pin.name, pin.sha256) {
        return Ok(Cached::Modified(format!("  its marker {} names {first:?}", marker_path.display())));
    }
    if rest.is_empty() {
        return Ok(Cached::Unverified(sub));
    }
    let recorded = match tree::parse_manifest(rest, &marker_path) {
        Ok(m) => m,
        Err(e) => return Ok(Cached::Modified(format!("  {e}"))),
    };
    let d = tree::diff_manifests(&recorded, &tree::manifest_of(&sub));
    Ok(if d.is_empty() { Cached::Good(sub) } else { Cached::Modified(d.describe(20)) })
}

/// The `.crate` in cargo's download cache whose sha256 equals the pin (`file`), else the first
/// one of that name and version whose bytes differ (`corrupt`: path and sha256).
#[derive(Default)]
struct Found {
    file: Option<PathBuf>,
    corrupt: Option<(PathBuf, String)>,
}

fn find_crate_file(pin: &CratePin) -> Result<Found, BaseError> {
    let cache = cargo_home().join("registry").join("cache");
    let mut found = Found::default();
    let Ok(indexes) = fs::read_dir(&cache) else {
        return Ok(found);
    };
    let mut indexes: Vec<PathBuf> = indexes.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
    indexes.sort();
    for index in indexes {
        let candidate = index.join(format!("{}-{}.crate", pin.name, pin.version));
        if let Ok(bytes) = fs::read(&candidate) {
            let sha = tree::sha256_hex(&bytes);
            if sha == pin.sha256 {
                found.file = Some(candidate);
                return Ok(found);
            }
            found.corrupt.get_or_insert((candidate, sha));
        }
    }
    Ok(found)
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
        if find_crate_file(&pin)?.file.is_none() {
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

/// The files of a `.crate`, after checking its sha256 against the pin.
fn crate_files(crate_file: &Path, pin: &CratePin) -> Result<Tree, BaseError> {
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
        if !tree::is_safe_path(&rel) || rel == ".complete" {
            return Err(BaseError::UnsafePath { file: crate_file.to_owned(), entry: path });
        }
        let mode = if entry.header().mode()? & 0o111 != 0 { MODE_EXEC } else { MODE_FILE };
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut data)?;
        files.insert(rel, Entry { mode, data });
    }
    Ok(files)
}

/// Unpacks `files` read-only at `dest`, with a marker recording their manifest.
fn install(files: &Tree, pin: &CratePin, dest: &Path) -> Result<(), BaseError> {
    // Unpack beside the destination, then rename: a half-unpacked cache never looks complete.
    let parent = dest.parent().expect("cache directories have parents");
    fs::create_dir_all(parent)?;
    let tmp = parent.join(format!(".unpack-{}-{}", pin.name, std::process::id()));
    if tmp.exists() {
        make_writable(&tmp)?;
        fs::remove_dir_all(&tmp)?;
    }
    for (rel, e) in files {
        let p = tmp.join(rel);
        fs::create_dir_all(p.parent().expect("joined"))?;
        fs::write(&p, &e.data)?;
        // Read-only: the cache is never modified.
        fs::set_permissions(&p, fs::Permissions::from_mode(if e.mode == MODE_EXEC { 0o555 } else { 0o444 }))?;
    }
    fs::write(tmp.join(".complete"), marker(pin, files))?;
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
