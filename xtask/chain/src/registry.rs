//! `upstream-sync/UPSTREAM_SYNC.toml`: the base pin and one entry per patch, in series order.
//!
//! The registry is the source of truth; `docs/UPSTREAM_SYNC.md` is generated from it and checked
//! byte for byte. The file is written back in one canonical layout (see [`render`]), so tools that
//! edit it (refresh, capture) produce reviewable, deterministic diffs.

use std::fmt::Write as _;
use std::path::Path;

use serde::Deserialize;

pub const STATUSES: &[&str] = &["carried", "submitted", "upstreamed", "retired"];
pub const BUMP_POLICIES: &[&str] = &["reapply", "drop-if-upstream", "reconcile"];

/// Whether `area` is one of `allowed` (the project's: its extension's `areas`), or
/// with none given, a lowercase word; the error names what is allowed.
pub fn check_area(area: &str, allowed: &[&str]) -> Result<(), String> {
    let ok = if allowed.is_empty() { !area.is_empty() && area.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') } else { allowed.contains(&area) };
    match (ok, allowed.is_empty()) {
        (true, _) => Ok(()),
        (false, true) => Err(format!("area {area:?} is not a lowercase word")),
        (false, false) => Err(format!("area {area:?} is not one of {}", allowed.join(", "))),
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Registry {
    pub base: Base,
    /// Where the project's own code starts to compile (see [`EngineReq`]).
    #[serde(default)]
    pub engine: Option<EngineReq>,
    #[serde(default, rename = "patch")]
    pub patches: Vec<PatchEntry>,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Base {
    /// Crates from the package registry, each pinned by the sha256 of its `.crate` file.
    Crates {
        #[serde(rename = "crate")]
        crates: Vec<CratePin>,
    },
    /// A local directory (relative to the project root, or absolute).
    Dir { path: String },
    /// A git repository at a pinned commit; `include` limits the tree to these top-level paths.
    Git {
        url: String,
        commit: String,
        #[serde(default)]
        include: Vec<String>,
    },
}

/// `[engine]`: the project's own code (what consumes the patched base) uses APIs up to this
/// patch, so it compiles only from `builds_from` on. The toolchain only keeps it (a rebase moves it
/// past a retired patch); the project's gate check decides what may sit before it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EngineReq {
    pub builds_from: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CratePin {
    pub name: String,
    pub version: String,
    pub sha256: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PatchEntry {
    pub id: String,
    pub file: String,
    pub sha256: String,
    pub title: String,
    pub area: String,
    #[serde(default)]
    pub hooks: Vec<String>,
    pub status: String,
    /// Upstream reference: an issue or PR (`huggingface/candle#3747`) or a version that has it.
    #[serde(default)]
    pub upstream: String,
    pub bump: String,
    #[serde(default)]
    pub gates: Vec<String>,
}

impl PatchEntry {
    /// A new patch's entry, as `capture` and `import` record it: carried, reapplied at a bump,
    /// gated by `apply` until someone adds its own suite.
    pub fn carried(id: &str, file: &str, bytes: &[u8], title: String, area: &str, hooks: Vec<String>) -> PatchEntry {
        PatchEntry {
            id: id.to_owned(),
            file: file.to_owned(),
            sha256: crate::tree::sha256_hex(bytes),
            title,
            area: area.to_owned(),
            hooks,
            status: "carried".into(),
            upstream: String::new(),
            bump: "reapply".into(),
            gates: vec!["apply".into()],
        }
    }

    /// Retired patches stay in the registry as history but are not part of the chain.
    pub fn is_applied(&self) -> bool {
        self.status != "retired"
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}")]
    Io {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid registry")]
    Toml {
        path: std::path::PathBuf,
        #[source]
        source: toml::de::Error,
    },
}

pub fn load(path: &Path) -> Result<Registry, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io { path: path.to_owned(), source })?;
    parse(&text).map_err(|source| LoadError::Toml { path: path.to_owned(), source })
}

/// The registry in `text` (what [`load`] reads from a file).
pub fn parse(text: &str) -> Result<Registry, toml::de::Error> {
    toml::from_str(text)
}

fn q(s: &str) -> String {
    // TOML basic strings share JSON's escapes, except DEL (U+007F): JSON leaves it raw, TOML
    // forbids it raw in a basic string, so a registry holding one would render unloadable.
    serde_json::to_string(s).expect("strings serialise").replace('\u{7f}', "\\u007F")
}

fn list(items: &[String]) -> String {
    format!("[{}]", items.iter().map(|s| q(s)).collect::<Vec<_>>().join(", "))
}

/// The canonical text of a registry.
pub fn render(reg: &Registry) -> String {
    let mut out = String::new();
    let w = &mut out;
    writeln!(w, "# The upstream registry: the pinned base and the patch series, in order.").expect("String write");
    writeln!(w, "# Source of truth for `cargo xtask`; docs/UPSTREAM_SYNC.md is generated from it (`cargo xtask bless`).").expect("String write");
    writeln!(w, "# Tools rewrite this file in this layout; keep hand edits to values.\n").expect("String write");
    writeln!(w, "[base]").expect("String write");
    match &reg.base {
        Base::Crates { crates } => {
            writeln!(w, "kind = \"crates\"").expect("String write");
            for c in crates {
                writeln!(w, "\n[[base.crate]]\nname = {}\nversion = {}\nsha256 = {}", q(&c.name), q(&c.version), q(&c.sha256)).expect("String write");
            }
        }
        Base::Dir { path } => writeln!(w, "kind = \"dir\"\npath = {}", q(path)).expect("String write"),
        Base::Git { url, commit, include } => {
            writeln!(w, "kind = \"git\"\nurl = {}\ncommit = {}", q(url), q(commit)).expect("String write");
            if !include.is_empty() {
                writeln!(w, "include = {}", list(include)).expect("String write");
            }
        }
    }
    if let Some(e) = &reg.engine {
        writeln!(w, "\n# The project's own code compiles from this patch on; gates that build it sit on it or later.\n[engine]\nbuilds_from = {}", q(&e.builds_from)).expect("String write");
    }
    for p in &reg.patches {
        writeln!(w, "\n[[patch]]").expect("String write");
        writeln!(w, "id = {}\nfile = {}\nsha256 = {}\ntitle = {}\narea = {}", q(&p.id), q(&p.file), q(&p.sha256), q(&p.title), q(&p.area)).expect("String write");
        writeln!(w, "hooks = {}\nstatus = {}\nupstream = {}\nbump = {}\ngates = {}", list(&p.hooks), q(&p.status), q(&p.upstream), q(&p.bump), list(&p.gates)).expect("String write");
    }
    out
}

/// The generated, human-readable table of the registry.
pub fn render_markdown(reg: &Registry) -> String {
    let mut out = String::new();
    let w = &mut out;
    writeln!(w, "# Upstream sync\n").expect("String write");
    writeln!(w, "Generated from `upstream-sync/UPSTREAM_SYNC.toml` by `cargo xtask bless`; `cargo xtask sync-check` fails when it is stale.").expect("String write");
    writeln!(w, "Do not edit by hand.\n").expect("String write");
    writeln!(w, "## Base\n").expect("String write");
    match &reg.base {
        Base::Crates { crates } => {
            writeln!(w, "Crates from the package registry, pinned by the sha256 of each `.crate` file.\n").expect("String write");
            writeln!(w, "| crate | version | sha256 |\n|---|---|---|").expect("String write");
            for c in crates {
                writeln!(w, "| {} | {} | `{}` |", c.name, c.version, c.sha256).expect("String write");
            }
        }
        Base::Dir { path } => writeln!(w, "A local directory: `{path}`.").expect("String write"),
        Base::Git { url, commit, include } => {
            writeln!(w, "A git repository: `{url}` at `{commit}`.").expect("String write");
            if !include.is_empty() {
                writeln!(w, "\nOnly these paths: {}.", include.iter().map(|i| format!("`{i}`")).collect::<Vec<_>>().join(", ")).expect("String write");
            }
        }
    }
    writeln!(w, "\n## Patches\n").expect("String write");
    if reg.patches.is_empty() {
        writeln!(w, "The series is empty.").expect("String write");
        return out;
    }
    writeln!(w, "| id | title | area | hooks | status | upstream | bump | gates |\n|---|---|---|---|---|---|---|---|").expect("String write");
    for p in &reg.patches {
        let code = |v: &[String]| v.iter().map(|s| format!("`{}`", s.replace('|', "\\|"))).collect::<Vec<_>>().join(", ");
        writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            p.id,
            p.title.replace('|', "\\|"),
            p.area,
            code(&p.hooks),
            p.status,
            if p.upstream.is_empty() { "—".to_owned() } else { p.upstream.clone() },
            p.bump,
            code(&p.gates)
        )
        .expect("String write");
    }
    out
}

/// Why a gate name cannot sit in a patch's suite, as the project's gate grammar says
/// (`Extension::check_gate`). Displays as its reason alone.
#[derive(Debug, thiserror::Error)]
pub enum GateSpecError {
    /// The name does not parse.
    #[error(transparent)]
    Malformed(Box<dyn std::error::Error + Send + Sync>),
    /// The gate parses but cannot run on this patch (for example, it needs code that compiles
    /// only from a later patch on).
    #[error(transparent)]
    Misplaced(Box<dyn std::error::Error + Send + Sync>),
}

/// Checks one gate of a patch's suite; `lint` reports an error as `patch NNNN: <error>`.
pub type GateCheck<'a> = &'a dyn Fn(&Registry, &PatchEntry, &str) -> Result<(), GateSpecError>;

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Every problem with the registry's own content (files are checked by `sync_check`); each gate
/// name is checked by `check_gate`, the project's grammar, and each area against `areas`, the
/// project's (empty: any lowercase word).
pub fn lint(reg: &Registry, check_gate: GateCheck<'_>, areas: &[&str]) -> Vec<String> {
    let mut problems = Vec::new();
    match &reg.base {
        Base::Crates { crates } => {
            if crates.is_empty() {
                problems.push("[base] kind = \"crates\" lists no crates".to_owned());
            }
            for c in crates {
                if !is_hex(&c.sha256, 64) {
                    problems.push(format!("base crate {}: sha256 must be 64 lowercase hex digits", c.name));
                }
            }
        }
        Base::Git { commit, .. } if !is_hex(commit, 40) => problems.push("[base] git commit must be a full 40-hex id".to_owned()),
        _ => {}
    }
    let mut last_id: Option<&str> = None;
    let mut hooks_seen = std::collections::BTreeMap::new();
    for p in &reg.patches {
        let who = format!("patch {}", p.id);
        if p.id.len() != 4 || !p.id.bytes().all(|b| b.is_ascii_digit()) || p.id == "0000" {
            problems.push(format!("{who}: id must be four digits, 0001-9999"));
        }
        if let Some(prev) = last_id {
            if p.id.as_str() <= prev {
                problems.push(format!("{who}: ids must increase in series order (follows {prev})"));
            }
        }
        last_id = Some(&p.id);
        let slug = p.file.strip_prefix(&format!("{}-", p.id)).and_then(|s| s.strip_suffix(".patch"));
        match slug {
            Some(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') => {}
            _ => problems.push(format!("{who}: file {:?} must be named {}-<slug>.patch with a lowercase slug", p.file, p.id)),
        }
        if !is_hex(&p.sha256, 64) {
            problems.push(format!("{who}: sha256 must be 64 lowercase hex digits"));
        }
        if p.title.trim().is_empty() {
            problems.push(format!("{who}: title is empty"));
        }
        if let Err(e) = check_area(&p.area, areas) {
            problems.push(format!("{who}: {e}"));
        }
        if !STATUSES.contains(&p.status.as_str()) {
            problems.push(format!("{who}: status {:?} is not one of {}", p.status, STATUSES.join(", ")));
        }
        if !BUMP_POLICIES.contains(&p.bump.as_str()) {
            problems.push(format!("{who}: bump {:?} is not one of {}", p.bump, BUMP_POLICIES.join(", ")));
        }
        if (p.status == "submitted" || p.status == "upstreamed" || p.bump == "drop-if-upstream") && p.upstream.trim().is_empty() {
            problems.push(format!("{who}: status {:?} / bump {:?} needs an upstream reference", p.status, p.bump));
        }
        for h in &p.hooks {
            if h.is_empty() || !h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.') {
                problems.push(format!("{who}: hook name {h:?} must be [A-Za-z0-9._-]+"));
            }
            if let Some(other) = hooks_seen.insert(h.clone(), p.id.clone()) {
                problems.push(format!("{who}: hook {h:?} is also declared by patch {other}; hook names are unique"));
            }
        }
        if p.is_applied() && p.gates.is_empty() {
            problems.push(format!("{who}: no gates; every patch needs a suite that would fail without it"));
        }
        for g in &p.gates {
            if let Err(e) = check_gate(reg, p, g) {
                problems.push(format!("{who}: {e}"));
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_round_trips() {
        let text = r#"
[base]
kind = "crates"
[[base.crate]]
name = "candle-core"
version = "0.11.0"
sha256 = "5ecb245093b0f791b89d3420c3df9c6d49c60ab63ba54db896bf8a3baf486706"
[engine]
builds_from = "0001"
[[patch]]
id = "0001"
file = "0001-kv.patch"
sha256 = "5ecb245093b0f791b89d3420c3df9c6d49c60ab63ba54db896bf8a3baf486706"
title = "kv: truncate"
area = "kv"
hooks = ["kv-truncate"]
status = "carried"
bump = "reapply"
gates = ["apply", "test:-p tine-runtime"]
"#;
        let reg: Registry = toml::from_str(text).expect("valid registry");
        let again: Registry = toml::from_str(&render(&reg)).expect("rendered registry parses");
        assert_eq!(reg, again);
        let any: GateCheck<'_> = &|_, _, _| Ok(());
        assert!(lint(&reg, any, &[]).is_empty(), "{:?}", lint(&reg, any, &[]));
    }
}
