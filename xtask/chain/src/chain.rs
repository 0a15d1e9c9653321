//! The chain: base + patches in series order, and the live `engine/upstream/` tree.
//!
//! Invariant: `engine/upstream/` is only ever written whole and atomically, together with a state
//! file that records which patches it holds and the manifest it was written with. Anything in the
//! live tree that differs from that manifest is a maintainer's edit, and no command discards it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::apply;
use crate::base::BaseError;
use crate::extension::Extension;
use crate::journal::{self, JournalError};
use crate::patch::{self, ParseError, PatchSet};
use crate::project::Project;
use crate::registry::{self, LoadError, PatchEntry, Registry};
use crate::tree::{self, ManifestParseError, ReadTreeError, Tree, WriteError};

/// Reading the series' patch files.
#[derive(Debug, thiserror::Error)]
pub enum PatchLoadError {
    #[error("patch {id}: cannot read {shown} (the registry lists it; is the file missing?)")]
    Read {
        id: String,
        path: PathBuf,
        shown: String,
        #[source]
        source: std::io::Error,
    },
    #[error("patch {id}: the registry's file {file:?} is not a plain file name in patches/ (it would be read or written outside it)")]
    UnsafeFile { id: String, file: String },
    #[error("patch {id}: {shown} is malformed")]
    Parse {
        id: String,
        path: PathBuf,
        shown: String,
        #[source]
        source: ParseError,
    },
}

/// A `--to NNNN` that names no patch of the series.
#[derive(Debug, thiserror::Error)]
#[error("no patch {id:?} in the series (known: 0000, {})", .known.join(", "))]
pub struct ResolveError {
    pub id: String,
    pub known: Vec<String>,
}

/// Reading the live tree and its state file.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error(transparent)]
    Read(#[from] ReadTreeError),
    #[error("{shown} is corrupt; `cargo xtask backup` then delete it to adopt the tree")]
    CorruptState {
        path: PathBuf,
        shown: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Why a command may not replace the live tree: it holds something no patch carries.
#[derive(Debug, thiserror::Error)]
pub enum LiveEditsError {
    #[error(transparent)]
    Live(#[from] LiveError),
    #[error(
        "{live} holds edits that no patch carries, so `{verb}` would lose them:\n{drift}\n\
         keep them first, with one of:\n  cargo xtask refresh {top}            (fold them into patch {top}, the top of the applied chain)\n  cargo xtask capture NNNN-slug        (record them as a new patch after {top})\n  cargo xtask backup                   (snapshot {live}, after which `{verb}` may replace it; `cargo xtask restore` brings it back)"
    )]
    Edits {
        /// The live tree, as messages name it ([`Project::live_name`]).
        live: String,
        verb: String,
        /// The drifted files, described.
        drift: String,
        top: String,
    },
    #[error("{live} holds patches {applied:?}, which is not a prefix of the series {series:?}; `cargo xtask backup`, then remove {live} and apply again")]
    NotAPrefix { live: String, applied: Vec<String>, series: Vec<String> },
    #[error(
        "{live} has no chain state and matches no prefix of the chain, so `{verb}` would lose whatever it holds;\n\
         keep it with `cargo xtask backup`, then remove {live} and run `cargo xtask apply-chain`"
    )]
    Unknown { live: String, verb: String },
}

/// Step 1 of verify: the base against `manifest.pristine`.
#[derive(Debug, thiserror::Error)]
pub enum PristineError {
    #[error("cannot read {shown} (record it once with `cargo xtask bless --base`)")]
    Read {
        shown: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Parse(#[from] ManifestParseError),
    #[error("the pristine base does not match {shown} (a corrupted cache or a changed base):\n{drift}")]
    Differs { shown: String, drift: String },
}

/// Loading registry, base and series.
#[derive(Debug, thiserror::Error)]
pub enum LoadAllError {
    #[error("{0}\n(the chain commands wait until the rebase is finished or aborted)")]
    RebaseInProgress(String),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Registry(#[from] LoadError),
    #[error(transparent)]
    Base(#[from] BaseError),
    #[error(transparent)]
    Pristine(#[from] PristineError),
    #[error(transparent)]
    Patches(#[from] PatchLoadError),
}

/// A path a patch touches runs through a symbolic link in the live tree.
#[derive(Debug, thiserror::Error)]
#[error("patch {patch} touches {path}, but {live}{link} is a symbolic link (to {target}); the chain never writes through links, and a tree holding one is not the chain's:\nmove it away (keep what it points to), then run again")]
pub struct LinkError {
    /// The live tree, as messages name it ([`Project::live_name`]).
    pub live: String,
    pub patch: String,
    pub path: String,
    pub link: String,
    pub target: String,
}

/// Recording sha256s, manifests, docs and generated files.
#[derive(Debug, thiserror::Error)]
pub enum BlessError {
    #[error("reading {shown}")]
    Read {
        shown: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Patches(#[from] PatchLoadError),
}

/// A refusal that protects a maintainer's work: edits in the live tree that no patch carries
/// (the CLI's exit code 3).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// One patch of the series, read and parsed.
#[derive(Clone, Debug)]
pub struct LoadedPatch {
    pub entry: PatchEntry,
    pub bytes: Vec<u8>,
    pub parsed: PatchSet,
}

impl LoadedPatch {
    pub fn name(&self) -> &str {
        &self.entry.file
    }
}

pub fn load_registry(p: &Project) -> Result<Registry, LoadError> {
    registry::load(&p.registry_path())
}

/// Reads and parses every applied patch of the series.
pub fn load_patches(p: &Project, reg: &Registry) -> Result<Vec<LoadedPatch>, PatchLoadError> {
    load_patches_with(p, reg, &BTreeMap::new())
}

/// A registry `file` names a plain file in `patches/`.
pub fn is_plain_patch_file(file: &str) -> bool {
    !file.is_empty() && !file.starts_with('.') && !file.contains('/') && !file.contains('\\') && !file.contains('\0')
}

/// [`load_patches`], with `overrides` (file name -> bytes) read instead of the files on disk:
/// a change not yet written.
pub fn load_patches_with(p: &Project, reg: &Registry, overrides: &BTreeMap<String, Vec<u8>>) -> Result<Vec<LoadedPatch>, PatchLoadError> {
    reg.patches
        .iter()
        .filter(|e| e.is_applied())
        .map(|entry| {
            if !is_plain_patch_file(&entry.file) {
                return Err(PatchLoadError::UnsafeFile { id: entry.id.clone(), file: entry.file.clone() });
            }
            let path = p.patches_dir().join(&entry.file);
            let shown = p.rel(&path).into_owned();
            let bytes = match overrides.get(&entry.file) {
                Some(b) => b.clone(),
                None => match fs::read(&path) {
                    Ok(b) => b,
                    Err(source) => return Err(PatchLoadError::Read { id: entry.id.clone(), path, shown, source }),
                },
            };
            let parsed = match patch::parse(&bytes) {
                Ok(ps) => ps,
                Err(source) => return Err(PatchLoadError::Parse { id: entry.id.clone(), path, shown, source }),
            };
            Ok(LoadedPatch { entry: entry.clone(), bytes, parsed })
        })
        .collect()
}

/// Index into `patches` after which to stop: `--to NNNN` (`0000` = none).
pub fn resolve_to(patches: &[LoadedPatch], to: Option<&str>) -> Result<usize, ResolveError> {
    match to {
        None => Ok(patches.len()),
        Some("0000") | Some("0") => Ok(0),
        Some(id) => {
            let id = id.trim_end_matches(".patch");
            match patches.iter().position(|p| p.entry.id == id || p.entry.file.trim_end_matches(".patch") == id) {
                Some(i) => Ok(i + 1),
                None => Err(ResolveError { id: id.to_owned(), known: patches.iter().map(|p| p.entry.id.clone()).collect() }),
            }
        }
    }
}

/// Applies `patches` strictly, in order, to `base`.
pub fn build(base: &Tree, patches: &[LoadedPatch]) -> Result<Tree, apply::ApplyError> {
    let mut t = base.clone();
    for p in patches {
        apply::apply(&mut t, &p.parsed, p.name())?;
    }
    Ok(t)
}

/// What `apply-chain` wrote into `engine/upstream/`, kept inside it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct State {
    /// Ids of the applied patches, in order.
    pub applied: Vec<String>,
    /// sha256 of each applied patch file when it was applied.
    pub patch_sha256: Vec<String>,
    /// `path -> [sha256, mode]` of the tree as written.
    pub manifest: BTreeMap<String, (String, u32)>,
}

impl State {
    pub fn new(patches: &[LoadedPatch], tree: &Tree) -> State {
        State { applied: patches.iter().map(|p| p.entry.id.clone()).collect(), patch_sha256: patches.iter().map(|p| tree::sha256_hex(&p.bytes)).collect(), manifest: tree::manifest_of(tree) }
    }
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("state serialises");
        v.push(b'\n');
        v
    }
    pub fn top(&self) -> &str {
        self.applied.last().map(|s| s.as_str()).unwrap_or("0000")
    }
}

/// The live tree and what we know about it.
pub struct Live {
    pub tree: Tree,
    pub state: Option<State>,
}

impl Live {
    pub fn read(p: &Project) -> Result<Option<Live>, LiveError> {
        let dir = p.upstream_dir();
        if !dir.exists() {
            return Ok(None);
        }
        let tree = tree::read_tree(&dir)?;
        let state_path = dir.join(tree::STATE_FILE);
        let state = match fs::read(&state_path) {
            Ok(b) => Some(serde_json::from_slice(&b).map_err(|source| LiveError::CorruptState { shown: p.rel(&state_path).into_owned(), path: state_path.clone(), source })?),
            Err(_) => None,
        };
        Ok(Some(Live { tree, state }))
    }

    /// Edits in the live tree that the tool did not write.
    pub fn drift(&self) -> Option<tree::ManifestDiff> {
        let state = self.state.as_ref()?;
        let d = tree::diff_manifests(&state.manifest, &tree::manifest_of(&self.tree));
        Some(d)
    }
}

/// The live tree, checked for maintainer edits. Returns the state (applied prefix) it holds.
/// A live tree without a state file is adopted when it equals some prefix of the chain.
pub fn live_state_without_edits(p: &Project, base: &Tree, patches: &[LoadedPatch], verb: &str) -> Result<Option<(Live, usize)>, LiveEditsError> {
    let Some(live) = Live::read(p)? else {
        return Ok(None);
    };
    match &live.state {
        Some(state) => {
            let drift = live.drift().expect("state is present");
            // Edits a backup holds exactly are safe: `cargo xtask restore` brings them back.
            if !drift.is_empty() && !backed_up(p, &live.tree) {
                return Err(LiveEditsError::Edits { live: p.live_name(), verb: verb.to_owned(), drift: drift.describe(20), top: state.top().to_owned() });
            }
            // The applied prefix must still be a prefix of the series (by id).
            let n = state.applied.len();
            let ids: Vec<&str> = patches.iter().map(|p| p.entry.id.as_str()).collect();
            if n > ids.len() || state.applied.iter().zip(&ids).any(|(a, b)| a != b) {
                return Err(LiveEditsError::NotAPrefix { live: p.live_name(), applied: state.applied.clone(), series: ids.iter().map(|s| (*s).to_owned()).collect() });
            }
            Ok(Some((live, n)))
        }
        None => {
            let mut t = base.clone();
            let live_manifest = tree::manifest_of(&live.tree);
            if tree::manifest_of(&t) == live_manifest {
                return Ok(Some((live, 0)));
            }
            for (i, lp) in patches.iter().enumerate() {
                if apply::apply(&mut t, &lp.parsed, lp.name()).is_err() {
                    break;
                }
                if tree::manifest_of(&t) == live_manifest {
                    return Ok(Some((live, i + 1)));
                }
            }
            Err(LiveEditsError::Unknown { live: p.live_name(), verb: verb.to_owned() })
        }
    }
}

/// Whether a backup (`cargo xtask backup`: an archive and its manifest in the backups
/// directory) holds exactly `tree`, so that replacing the live tree loses nothing.
fn backed_up(p: &Project, tree: &Tree) -> bool {
    let Ok(entries) = fs::read_dir(p.backups_dir()) else { return false };
    let want = tree::manifest_of(tree);
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|path| path.extension().is_some_and(|x| x == "manifest") && path.with_extension("tar").is_file())
        .any(|path| fs::read_to_string(&path).ok().and_then(|text| tree::parse_manifest(&text, &path).ok()).is_some_and(|m| m == want))
}

/// Writes `tree` as the live tree holding `patches`, atomically.
pub fn write_live(p: &Project, tree: &Tree, patches: &[LoadedPatch], progress: &indicatif::ProgressBar) -> Result<(), WriteError> {
    let state = State::new(patches, tree);
    let bytes = state.to_bytes();
    tree::write_tree_atomically(&p.upstream_dir(), tree, &[(tree::STATE_FILE, &bytes)], progress)
}

/// Loads base and series, and checks the base against its recorded manifest.
pub struct Loaded {
    pub registry: Registry,
    pub base: Tree,
    pub patches: Vec<LoadedPatch>,
}

pub fn load_all(p: &Project, progress: &indicatif::ProgressBar) -> Result<Loaded, LoadAllError> {
    if let Some(what) = crate::rebase_state::describe_in_progress(p) {
        return Err(LoadAllError::RebaseInProgress(what));
    }
    journal::check_none_pending(p)?;
    let registry = load_registry(p)?;
    let base = crate::base::load(&registry.base, &p.root, &p.cache_dir, progress)?;
    check_pristine(p, &base)?;
    let patches = load_patches(p, &registry)?;
    Ok(Loaded { registry, base, patches })
}

/// Step 1 of verify: the base equals `manifest.pristine`.
pub fn check_pristine(p: &Project, base: &Tree) -> Result<(), PristineError> {
    let path = p.pristine_manifest_path();
    let text = fs::read_to_string(&path).map_err(|source| PristineError::Read { shown: p.rel(&path).into_owned(), source })?;
    let recorded = tree::parse_manifest(&text, &path)?;
    let d = tree::diff_manifests(&recorded, &tree::manifest_of(base));
    if !d.is_empty() {
        return Err(PristineError::Differs { shown: p.rel(&path).into_owned(), drift: d.describe(20) });
    }
    Ok(())
}

/// The hooks a patch introduces: markers in its added lines that the tree before it lacks.
pub fn hooks_added(before: &Tree, after: &Tree) -> Vec<String> {
    let b = tree::hooks_of_tree(before);
    tree::hooks_of_tree(after).into_keys().filter(|h| !b.contains_key(h)).collect()
}

/// Every path `patches` touch, checked against symbolic links in the live tree (the path
/// itself or a directory above it), before anything is read or written there.
pub fn check_no_links(p: &Project, patches: &[LoadedPatch]) -> Result<(), LinkError> {
    let dir = p.upstream_dir();
    if !dir.is_dir() {
        return Ok(());
    }
    let mut clean = BTreeSet::new();
    for lp in patches {
        for fp in &lp.parsed.files {
            for path in fp.old_path.iter().chain(&fp.new_path) {
                let mut prefix = String::new();
                for comp in path.split('/') {
                    if !prefix.is_empty() {
                        prefix.push('/');
                    }
                    prefix.push_str(comp);
                    if clean.contains(&prefix) {
                        continue;
                    }
                    let Ok(meta) = fs::symlink_metadata(dir.join(&prefix)) else {
                        break;
                    };
                    if meta.file_type().is_symlink() {
                        let target = fs::read_link(dir.join(&prefix)).map(|t| t.display().to_string()).unwrap_or_else(|_| "?".into());
                        return Err(LinkError { live: p.live_name(), patch: lp.name().to_owned(), path: path.clone(), link: prefix, target });
                    }
                    clean.insert(prefix.clone());
                }
            }
        }
    }
    Ok(())
}

/// What [`bless`] writes, computed without writing: every file (absolute path, bytes) and
/// whether the chain applies (else `manifest.patched` is not among them). `overrides` are
/// patch files (name -> bytes) of the change being recorded, written with the rest.
pub type BlessFiles = (Vec<(PathBuf, Option<Vec<u8>>)>, Result<(), apply::ApplyError>);

pub fn bless_files(p: &Project, ext: &dyn Extension, reg: &mut Registry, base: &Tree, with_base: bool, overrides: &BTreeMap<String, Vec<u8>>) -> Result<BlessFiles, BlessError> {
    let patches = load_patches_with(p, reg, overrides)?;
    let mut files: Vec<(PathBuf, Option<Vec<u8>>)> = overrides.iter().map(|(f, b)| (p.patches_dir().join(f), Some(b.clone()))).collect();
    for e in &mut reg.patches {
        if let Some(lp) = patches.iter().find(|lp| lp.entry.id == e.id && lp.entry.file == e.file) {
            e.sha256 = tree::sha256_hex(&lp.bytes);
        }
    }
    files.push((p.registry_path(), Some(registry::render(reg).into_bytes())));
    files.push((p.sync_doc_path(), Some(registry::render_markdown(reg).into_bytes())));
    if with_base {
        files.push((p.pristine_manifest_path(), Some(tree::render_manifest(&tree::manifest_of(base)).into_bytes())));
    }
    for (path, bytes) in ext.generated_files(p, reg, &patches.iter().map(|l| &l.parsed).collect::<Vec<_>>()) {
        files.push((path, Some(bytes)));
    }
    match build(base, &patches) {
        Ok(full) => {
            files.push((p.patched_manifest_path(), Some(tree::render_manifest(&tree::manifest_of(&full)).into_bytes())));
            Ok((files, Ok(())))
        }
        Err(e) => Ok((files, Err(e))),
    }
}

/// Rewrites the registry's patch sha256s, `manifest.patched` (when the chain applies),
/// `docs/UPSTREAM_SYNC.md` and the extension's generated files from the files on disk,
/// all in one journaled change.
pub fn bless(p: &Project, ext: &dyn Extension, reg: &mut Registry, base: &Tree, with_base: bool) -> Result<Result<(), apply::ApplyError>, BlessError> {
    let (files, outcome) = bless_files(p, ext, reg, base, with_base, &BTreeMap::new())?;
    journal::commit(p, if with_base { "bless --base" } else { "bless" }, &files)?;
    Ok(outcome)
}
