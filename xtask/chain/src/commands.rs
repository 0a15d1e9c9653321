//! The chain commands: apply-chain, unapply, refresh, capture, backup, restore, status, bless, recover.
//!
//! Every writing command first finishes a change an earlier run was killed in the middle of
//! (its [`journal`]); then it writes either one atomic swap of the live tree (apply-chain,
//! unapply, restore) or one journaled set of files (refresh, capture, bless).

use std::collections::BTreeMap;
use std::fs;

use anyhow::{bail, Context as _};

use crate::apply;
pub use crate::chain::Refused;
use crate::chain::{self, build, live_state_without_edits, load_all, resolve_to, Live, LoadedPatch, State};
use crate::error::Causes;
use crate::export;
use crate::extension::Extension;
use crate::journal;
use crate::patch;
use crate::project::Project;
use crate::registry::{self, PatchEntry};
use crate::tree::{self, Tree};

fn say(msg: impl AsRef<str>) {
    eprintln!("{}", msg.as_ref());
}

/// Finishes a change that a killed run committed but did not write out completely.
fn finish_interrupted(p: &Project) -> anyhow::Result<()> {
    if let Some(what) = journal::recover(p)? {
        say(format!("finished the interrupted `{what}` (its journal {} is written out and removed)", p.rel(&journal::dir(p))));
    }
    Ok(())
}

/// `cargo xtask recover`: finishes an interrupted change, if there is one.
pub fn recover(p: &Project) -> anyhow::Result<()> {
    match journal::recover(p)? {
        Some(what) => say(format!("finished the interrupted `{what}`")),
        None => say("nothing to recover: no interrupted change is pending"),
    }
    Ok(())
}

/// The paths the series touches may not run through a symbolic link in the live tree.
fn refuse_links(p: &Project, patches: &[LoadedPatch]) -> anyhow::Result<()> {
    chain::check_no_links(p, patches).map_err(|e| Refused(e.to_string()).into())
}

pub fn apply_chain(p: &Project, to: Option<&str>, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    finish_interrupted(p)?;
    let l = load_all(p, pb)?;
    let n = resolve_to(&l.patches, to)?;
    refuse_links(p, &l.patches)?;
    let live = live_state_without_edits(p, &l.base, &l.patches, "apply-chain").map_err(|e| Refused(Causes(&e).to_string()))?;
    let mut t = l.base.clone();
    for lp in &l.patches[..n] {
        apply::apply(&mut t, &lp.parsed, lp.name())?;
    }
    let target = State::new(&l.patches[..n], &t);
    if let Some((live, _)) = &live {
        // (Edits a backup holds leave a drift: then the tree is written even at the same state.)
        if live.state.as_ref() == Some(&target) && live.drift().is_none_or(|d| d.is_empty()) {
            tree::remove_stale_scratch(&p.upstream_dir());
            say(format!("{} already holds the base + {n} patch(es) (up to {}); nothing to do", p.live_name(), target.top()));
            return Ok(());
        }
    }
    pb.set_message(format!("writing {}", p.live_name()));
    chain::write_live(p, &t, &l.patches[..n], pb)?;
    pb.finish_and_clear();
    for lp in &l.patches[..n] {
        say(format!("applied {}", lp.name()));
    }
    say(format!("{} = base + {n} of {} patch(es), up to {} ({} files)", p.live_name(), l.patches.len(), target.top(), t.len()));
    Ok(())
}

pub fn unapply(p: &Project, to: Option<&str>, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    finish_interrupted(p)?;
    let l = load_all(p, pb)?;
    let n = resolve_to(&l.patches, Some(to.unwrap_or("0000")))?;
    refuse_links(p, &l.patches)?;
    let Some((live, k)) = live_state_without_edits(p, &l.base, &l.patches, "unapply").map_err(|e| Refused(Causes(&e).to_string()))? else {
        bail!("{} does not exist; nothing to unapply (`cargo xtask apply-chain --to NNNN` builds a prefix)", p.live_name());
    };
    if n > k {
        bail!(
            "{} holds the chain up to {}; unapply only goes down (use `cargo xtask apply-chain --to {}`)",
            p.live_name(),
            live.state.as_ref().map(|s| s.top().to_owned()).unwrap_or_else(|| "0000".into()),
            l.patches[n - 1].entry.id
        );
    }
    let changed_since: Vec<&str> = match &live.state {
        Some(s) => l.patches[..k].iter().zip(&s.patch_sha256).filter(|(lp, sha)| tree::sha256_hex(&lp.bytes) != **sha).map(|(lp, _)| lp.name()).collect(),
        None => Vec::new(),
    };
    let mut t = live.tree.clone();
    // Edits a backup holds are not reversed through the patches: the prefix is rebuilt.
    let backed_up_edits = live.drift().is_some_and(|d| !d.is_empty());
    if changed_since.is_empty() && !backed_up_edits {
        for lp in l.patches[n..k].iter().rev() {
            apply::unapply(&mut t, &lp.parsed, lp.name())?;
            say(format!("unapplied {}", lp.name()));
        }
        // Reversibility is proved, not assumed: the result must equal the forward build.
        let forward = build(&l.base, &l.patches[..n])?;
        if tree::manifest_of(&forward) != tree::manifest_of(&t) {
            bail!("reverse-applying down to {} did not give the tree that applying forward gives; the chain is not reversible (run `cargo xtask verify`)", to.unwrap_or("0000"));
        }
    } else {
        // The live tree has no edits (or a backup holds them), so rebuilding forward loses nothing.
        if backed_up_edits {
            say(format!("{}'s edits are in a backup (`cargo xtask restore` brings them back); rebuilding the prefix from the base", p.live_name()));
        } else {
            say(format!("patch file(s) changed since they were applied ({}); rebuilding the prefix from the base instead of reversing", changed_since.join(", ")));
        }
        t = build(&l.base, &l.patches[..n])?;
    }
    chain::write_live(p, &t, &l.patches[..n], pb)?;
    pb.finish_and_clear();
    say(format!("{} = base + {n} patch(es)", p.live_name()));
    Ok(())
}

/// The live tree with its state, edits allowed (refresh and capture record them).
fn live_with_state(p: &Project, patches: &[LoadedPatch]) -> anyhow::Result<(Live, State, usize)> {
    let live = Live::read(p)?.with_context(|| format!("{} does not exist: `cargo xtask apply-chain --to NNNN`, edit, then refresh or capture", p.live_name()))?;
    let state = live.state.clone().with_context(|| format!("{} has no chain state; run `cargo xtask apply-chain` first (back it up with `cargo xtask backup` if it holds work)", p.live_name()))?;
    let k = state.applied.len();
    let ids: Vec<&str> = patches.iter().map(|lp| lp.entry.id.as_str()).collect();
    if k > ids.len() || state.applied.iter().zip(&ids).any(|(a, b)| a != b) {
        bail!("{} holds patches {:?}, not a prefix of the series {:?}", p.live_name(), state.applied, ids);
    }
    Ok((live, state, k))
}

/// Exports `old -> new` under `header`, and proves the export applies back to exactly `new`.
fn export_checked(header: &[u8], old: &Tree, new: &Tree, name: &str) -> anyhow::Result<Vec<u8>> {
    let mut bytes = header.to_vec();
    bytes.extend_from_slice(&export::diff_trees(old, new));
    let parsed = patch::parse(&bytes).with_context(|| format!("internal error: the exported {name} does not parse"))?;
    let mut check = old.clone();
    apply::apply(&mut check, &parsed, name).with_context(|| format!("internal error: the exported {name} does not apply to its own base"))?;
    if tree::manifest_of(&check) != tree::manifest_of(new) {
        bail!("internal error: the exported {name} does not reproduce the edited tree");
    }
    Ok(bytes)
}

/// Re-applies `later` on `t` in order, stopping at the first that no longer applies: the ones
/// after it were made on top of it, so applying them without it proves nothing either way.
/// Returns that patch's error and the names of the patches left unchecked.
fn reapply_later<'a>(t: &mut Tree, later: &'a [LoadedPatch]) -> Result<(), (Box<apply::ApplyError>, Vec<&'a str>)> {
    for (i, lp) in later.iter().enumerate() {
        if let Err(e) = apply::apply(t, &lp.parsed, lp.name()) {
            return Err((Box::new(e), later[i + 1..].iter().map(|lp| lp.name()).collect()));
        }
    }
    Ok(())
}

/// Records the new patch file (`overrides`), sha256s, docs, manifest.patched when the chain
/// applies, and the live tree's new state, as one journaled change; then names every later
/// patch that no longer applies.
#[allow(clippy::too_many_arguments)]
fn finish_bless(p: &Project, ext: &dyn Extension, reg: &mut registry::Registry, base: &Tree, live: &Tree, new_state: &State, overrides: &BTreeMap<String, Vec<u8>>, what: &str) -> anyhow::Result<()> {
    // A chain that no longer applies is reported below, patch by patch.
    let (mut files, _) = chain::bless_files(p, ext, reg, base, false, overrides)?;
    files.push((p.upstream_dir().join(tree::STATE_FILE), Some(new_state.to_bytes())));
    journal::commit(p, what, &files)?;
    let patches = chain::load_patches(p, reg)?;
    let mut t = live.clone();
    if let Err((e, unchecked)) = reapply_later(&mut t, &patches[new_state.applied.len()..]) {
        let rest = match unchecked.len() {
            0 => String::new(),
            n => format!("\nthe {n} patch(es) after it were not checked, since they build on it: {}", unchecked.join(", ")),
        };
        bail!(
            "later patches no longer apply on top of it (manifest.patched was left unchanged); the first that does not:\n  {e}{rest}\nfix it so it applies on top of the chain before it, then `cargo xtask bless` (and the same for any later one that breaks then)"
        );
    }
    Ok(())
}

pub fn refresh(p: &Project, ext: &dyn Extension, id: &str, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    finish_interrupted(p)?;
    let mut l = load_all(p, pb)?;
    let idx = resolve_to(&l.patches, Some(id))?;
    if idx == 0 {
        bail!("refresh needs a patch id, not 0000");
    }
    refuse_links(p, &l.patches)?;
    let (live, state, k) = live_with_state(p, &l.patches)?;
    if k != idx {
        bail!(
            "{} holds the chain up to {}; `refresh {id}` needs it applied up to {id} exactly, with your edits on top\n\
             (if you have edits now, keep them with `cargo xtask backup` first; then `cargo xtask apply-chain --to {id}`)",
            p.live_name(),
            state.top()
        );
    }
    let lp = &l.patches[idx - 1];
    let old = build(&l.base, &l.patches[..idx - 1])?;
    if tree::manifest_of(&old) == tree::manifest_of(&live.tree) {
        bail!("patch {} would become empty; to drop a patch, mark it `status = \"retired\"` in the registry and delete its file", lp.name());
    }
    let bytes = export_checked(&lp.parsed.header, &old, &live.tree, lp.name())?;
    let unchanged = bytes == lp.bytes;
    let declared: std::collections::BTreeSet<_> = lp.entry.hooks.iter().cloned().collect();
    for h in chain::hooks_added(&old, &live.tree) {
        if !declared.contains(&h) {
            say(format!("note: the patch now marks hook {h:?}, which its registry entry does not declare (add it to `hooks`)"));
        }
    }
    let overrides = BTreeMap::from([(lp.name().to_owned(), bytes)]);
    let reloaded = chain::load_patches_with(p, &l.registry, &overrides)?;
    let new_state = State::new(&reloaded[..idx], &live.tree);
    say(if unchanged { format!("{} is unchanged", lp.name()) } else { format!("refreshed {}", lp.name()) });
    finish_bless(p, ext, &mut l.registry, &l.base, &live.tree, &new_state, &overrides, &format!("refresh {id}"))
}

pub struct CaptureOptions<'a> {
    pub name: &'a str,
    pub after: Option<&'a str>,
    pub title: Option<&'a str>,
    pub area: &'a str,
    pub upstream_status: &'a str,
}

pub fn capture(p: &Project, ext: &dyn Extension, o: &CaptureOptions<'_>, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    finish_interrupted(p)?;
    let mut l = load_all(p, pb)?;
    let name = o.name.trim_end_matches(".patch");
    // The slug becomes a file name in patches/: lowercase letters, digits and dashes only (as `sync-check` wants).
    let (id, slug) = name
        .split_once('-')
        .filter(|(id, s)| id.len() == 4 && id.bytes().all(|b| b.is_ascii_digit()) && !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'))
        .with_context(|| format!("capture takes NNNN-slug with a slug of lowercase letters, digits and dashes (for example 0002-kv-rollback), not {name:?}"))?;
    refuse_links(p, &l.patches)?;
    if l.registry.patches.iter().any(|e| e.id == id) {
        bail!("patch id {id} is already in the registry");
    }
    let (live, state, k) = live_with_state(p, &l.patches)?;
    if let Some(after) = o.after {
        let want = resolve_to(&l.patches, Some(after))?;
        if want != k {
            bail!("{} holds the chain up to {}; `capture --after {after}` needs it applied up to {after} with your edits on top", p.live_name(), state.top());
        }
    }
    let prev = state.top();
    let next = l.patches.get(k).map(|lp| lp.entry.id.as_str());
    if id <= prev || next.is_some_and(|n| id >= n) {
        bail!("patch {id} would sit after {prev}{}; pick an id in between", next.map(|n| format!(" and before {n}")).unwrap_or_default());
    }
    let old = build(&l.base, &l.patches[..k])?;
    if tree::manifest_of(&old) == tree::manifest_of(&live.tree) {
        bail!("{} holds no edits on top of {prev}; nothing to capture", p.live_name());
    }
    let hooks = chain::hooks_added(&old, &live.tree);
    let title = o.title.map(str::to_owned).unwrap_or_else(|| slug.replace('-', " "));
    let mut header = format!("Subject: [PATCH] {title}\n\n");
    for h in &hooks {
        header.push_str(&format!("Tine-Hook: {h}\n"));
    }
    header.push_str(&format!("Upstream-Status: {}\n---\n", o.upstream_status));
    let file = format!("{name}.patch");
    let bytes = export_checked(header.as_bytes(), &old, &live.tree, &file)?;
    let entry = PatchEntry::carried(id, &file, &bytes, title, o.area, hooks.clone());
    // Insert after the registry entry of the top applied patch (retired entries keep their places).
    let pos = match l.registry.patches.iter().position(|e| e.id == prev) {
        Some(i) => i + 1,
        None => 0,
    };
    l.registry.patches.insert(pos, entry);
    let overrides = BTreeMap::from([(file.clone(), bytes)]);
    let patches = chain::load_patches_with(p, &l.registry, &overrides)?;
    let new_state = State::new(&patches[..k + 1], &live.tree);
    say(format!("captured {file} ({} hook(s): {})", hooks.len(), hooks.join(", ")));
    finish_bless(p, ext, &mut l.registry, &l.base, &live.tree, &new_state, &overrides, &format!("capture {name}"))
}

fn timestamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock after 1970").as_secs();
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days as i64 + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The archive and its manifest are written as one journaled change.
pub fn backup(p: &Project, name: Option<&str>) -> anyhow::Result<String> {
    finish_interrupted(p)?;
    let live = Live::read(p)?.with_context(|| format!("{} does not exist; nothing to back up", p.live_name()))?;
    let name = name.map(str::to_owned).unwrap_or_else(timestamp);
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        bail!("backup name {name:?} must be a plain file name");
    }
    let dir = p.backups_dir();
    let archive_path = dir.join(format!("{name}.tar"));
    if archive_path.exists() {
        bail!("backup {name} already exists ({}); pick another name", p.rel(&archive_path));
    }
    let state = live.state.as_ref().map(|s| s.to_bytes());
    let bytes = tree::tar_tree(&live.tree, state.as_deref())?;
    let manifest = tree::render_manifest(&tree::manifest_of(&live.tree));
    journal::commit(p, &format!("backup {name}"), &[(dir.join(format!("{name}.manifest")), Some(manifest.into_bytes())), (archive_path.clone(), Some(bytes))])?;
    say(format!("backed up {} ({} files) to {}", p.live_name(), live.tree.len(), p.rel(&archive_path)));
    Ok(name)
}

pub fn restore(p: &Project, name: Option<&str>, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    finish_interrupted(p)?;
    let dir = p.backups_dir();
    let name = match name {
        Some(n) => {
            let n = n.trim_end_matches(".tar");
            if n.is_empty() || n.contains('/') || n.starts_with('.') {
                bail!("backup name {n:?} must be a plain file name in {}", p.rel(&dir));
            }
            n.to_owned()
        }
        None => {
            let mut names: Vec<String> =
                fs::read_dir(&dir).with_context(|| format!("no backups in {}", p.rel(&dir)))?.filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".tar").map(str::to_owned)).collect();
            names.sort();
            names.pop().with_context(|| format!("no backups in {}", p.rel(&dir)))?
        }
    };
    let archive_path = dir.join(format!("{name}.tar"));
    let bytes = fs::read(&archive_path).with_context(|| format!("no backup {name} ({})", p.rel(&archive_path)))?;
    let (t, state_bytes) = tree::untar_tree(&bytes).with_context(|| format!("backup {name} ({}) is damaged", p.rel(&archive_path)))?;
    let manifest_path = dir.join(format!("{name}.manifest"));
    let recorded = tree::parse_manifest(&fs::read_to_string(&manifest_path).with_context(|| format!("reading {}", p.rel(&manifest_path)))?, &manifest_path)?;
    if recorded != tree::manifest_of(&t) {
        bail!("backup {name} does not match its manifest; the archive is damaged");
    }
    if let Some(live) = Live::read(p)? {
        let unsaved = match live.drift() {
            Some(d) => !d.is_empty(),
            None => true,
        };
        if unsaved && tree::manifest_of(&live.tree) != recorded {
            return Err(
                Refused(format!("{} holds edits that no patch or backup carries; restoring {name} would lose them.\nback them up first (`cargo xtask backup`), then restore", p.live_name())).into()
            );
        }
    }
    let extra: Vec<(&str, &[u8])> = state_bytes.as_deref().map(|s| vec![(tree::STATE_FILE, s)]).unwrap_or_default();
    tree::write_tree_atomically(&p.upstream_dir(), &t, &extra, pb)?;
    pb.finish_and_clear();
    say(format!("restored {} from backup {name} ({} files)", p.live_name(), t.len()));
    Ok(())
}

pub fn status(p: &Project, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    let l = load_all(p, pb)?;
    pb.finish_and_clear();
    match &l.registry.base {
        registry::Base::Crates { crates } => println!("base: {}", crates.iter().map(|c| format!("{} {}", c.name, c.version)).collect::<Vec<_>>().join(", ")),
        registry::Base::Dir { path } => println!("base: directory {path}"),
        registry::Base::Git { url, commit, .. } => println!("base: git {url} @ {commit}"),
    }
    println!("base files: {} (matches manifest.pristine)", l.base.len());
    println!("series: {} patch(es)", l.patches.len());
    let live = Live::read(p)?;
    let applied = live.as_ref().and_then(|l| l.state.as_ref()).map(|s| s.applied.clone()).unwrap_or_default();
    for lp in &l.patches {
        let mark = if applied.contains(&lp.entry.id) { "applied" } else { "-" };
        println!("  {:8} {} [{}] {}", mark, lp.name(), lp.entry.status, lp.entry.title);
    }
    match live {
        None => println!("{}: absent (run `cargo xtask apply-chain`)", p.live_name()),
        Some(live) => match (&live.state, live.drift()) {
            (Some(s), Some(d)) => {
                println!("{}: base + {} patch(es), up to {}", p.live_name(), s.applied.len(), s.top());
                for ((id, sha), lp) in s.applied.iter().zip(&s.patch_sha256).zip(&l.patches) {
                    if *sha != tree::sha256_hex(&lp.bytes) {
                        println!("  patch {id} changed since it was applied: `cargo xtask apply-chain`");
                    }
                }
                if d.is_empty() {
                    println!("drift: none");
                } else {
                    println!("drift (edits no patch carries):\n{}", d.describe(50));
                }
            }
            _ => println!("{}: present, without chain state", p.live_name()),
        },
    }
    Ok(())
}

pub fn bless(p: &Project, ext: &dyn Extension, with_base: bool, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    finish_interrupted(p)?;
    let mut reg = chain::load_registry(p)?;
    let base = crate::base::load(&reg.base, &p.root, &p.cache_dir, pb)?;
    if !with_base {
        chain::check_pristine(p, &base)?;
    }
    let outcome = chain::bless(p, ext, &mut reg, &base, with_base)?;
    pb.finish_and_clear();
    if let Err(e) = outcome {
        bail!("recorded sha256s and docs, but the chain does not apply, so manifest.patched was not written:\n  {e}");
    }
    say("recorded patch sha256s, manifest.patched and docs/UPSTREAM_SYNC.md");
    Ok(())
}

/// `cargo xtask import`: [`crate::import::import`], its refusal to strand edits as exit code 3.
pub fn import(p: &Project, ext: &dyn Extension, o: &crate::import::ImportOptions<'_>, pb: &indicatif::ProgressBar) -> anyhow::Result<()> {
    use crate::import::ImportError;
    finish_interrupted(p)?;
    let done = match crate::import::import(p, ext, o, pb) {
        Ok(done) => done,
        Err(e @ ImportError::LiveEdits(_)) => return Err(Refused(e.to_string()).into()),
        Err(e) => return Err(e.into()),
    };
    pb.finish_and_clear();
    say(format!("imported {} as {} ({} hook(s): {})", o.file.display(), done.file, done.hooks.len(), done.hooks.join(", ")));
    if done.rebuilt_live {
        say(format!("{} held later patches and was rebuilt to include it", p.live_name()));
    }
    say("recorded its registry entry, patch sha256s, manifest.patched and docs/UPSTREAM_SYNC.md; gate it with `cargo xtask gate --patch` once it has tests");
    Ok(())
}
