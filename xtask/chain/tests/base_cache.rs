//! A corrupt base cache is detected and never used silently.
//!
//! The `.crate` files come from cargo's download cache (`$CARGO_HOME/registry/cache/*/`); this
//! test binary points `CARGO_HOME` at a directory of its own holding fixture crates (gzipped
//! tars made here, pinned by their sha256), and `CARGO` at `false`, so nothing reaches the
//! network: a fetch attempt fails at once. Each test uses its own crate name and cache.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use patchchain::base::{self, BaseError};
use patchchain::registry::{Base, CratePin};
use patchchain::tree::{self, Tree};

fn cargo_home() -> &'static Path {
    static HOME: OnceLock<tempfile::TempDir> = OnceLock::new();
    HOME.get_or_init(|| {
        let d = tempfile::tempdir().expect("tempdir");
        // Set once, before any test reads it; every test of this binary sees the same values.
        std::env::set_var("CARGO_HOME", d.path());
        std::env::set_var("CARGO", "false");
        d
    })
    .path()
}

fn crate_bytes(name: &str, files: &[(&str, &[u8])]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut b = tar::Builder::new(gz);
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, format!("{name}-1.0.0/{path}"), *data).expect("append");
    }
    b.into_inner().expect("tar").finish().expect("gz")
}

/// Puts `name-1.0.0.crate` into the fixture cargo cache; returns its pin and path.
fn publish(name: &str) -> (CratePin, PathBuf) {
    let bytes = crate_bytes(name, &[("Cargo.toml", b"[package]\nname = \"x\"\n"), ("src/lib.rs", b"pub fn f() {}\n"), ("src/deep/m.rs", b"// m\n")]);
    let dir = cargo_home().join("registry/cache/index.example-0000000000000000");
    fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join(format!("{name}-1.0.0.crate"));
    fs::write(&path, &bytes).expect("write");
    (CratePin { name: name.to_owned(), version: "1.0.0".to_owned(), sha256: tree::sha256_hex(&bytes) }, path)
}

fn load(pin: &CratePin, cache: &Path) -> Result<Tree, BaseError> {
    base::load(&Base::Crates { crates: vec![pin.clone()] }, cache, cache, &indicatif::ProgressBar::hidden())
}

fn cached_dir(pin: &CratePin, cache: &Path) -> PathBuf {
    cache.join("base/crates").join(format!("{}-{}-{}", pin.name, pin.version, &pin.sha256[..16]))
}

fn writable(p: &Path) {
    fs::set_permissions(p, fs::Permissions::from_mode(0o644)).expect("chmod");
}

#[test]
fn a_modified_cached_tree_is_detected_and_unpacked_again_from_the_pinned_crate() {
    let (pin, _) = publish("fx-modified");
    let cache = tempfile::tempdir().expect("cache");
    let good = load(&pin, cache.path()).expect("first load unpacks");
    assert_eq!(good.keys().collect::<Vec<_>>(), ["fx-modified/Cargo.toml", "fx-modified/src/deep/m.rs", "fx-modified/src/lib.rs"]);
    let dir = cached_dir(&pin, cache.path());
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 5] = [
        ("an edited file", |d| {
            writable(&d.join("src/lib.rs"));
            fs::write(d.join("src/lib.rs"), "pub fn f() { evil() }\n").expect("edit");
        }),
        ("a truncated file", |d| {
            writable(&d.join("Cargo.toml"));
            fs::write(d.join("Cargo.toml"), "[pack").expect("truncate");
        }),
        ("a removed file", |d| fs::remove_file(d.join("src/deep/m.rs")).expect("rm")),
        ("an added file", |d| fs::write(d.join("src/extra.rs"), "x").expect("add")),
        ("a mode change", |d| fs::set_permissions(d.join("src/lib.rs"), fs::Permissions::from_mode(0o755)).expect("chmod")),
    ];
    for (what, damage) in damages {
        damage(&dir);
        let again = load(&pin, cache.path()).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(again, good, "{what}: the tree used is the pinned one");
        assert_eq!(tree::manifest_of(&tree::read_tree(&dir).expect("cache")).len(), 4, "{what}: the cache itself is repaired (3 files + marker)");
        assert!(base::check_cached(&dir, &pin).expect("check").expect("cached").is_ok(), "{what}: the repaired cache checks");
    }
}

#[test]
fn a_modified_cached_tree_without_its_crate_is_refused_naming_the_cache() {
    let (pin, crate_path) = publish("fx-nocrate");
    let cache = tempfile::tempdir().expect("cache");
    load(&pin, cache.path()).expect("first load unpacks");
    fs::remove_file(&crate_path).expect("cargo cleaned its cache");
    let dir = cached_dir(&pin, cache.path());
    writable(&dir.join("src/lib.rs"));
    fs::write(dir.join("src/lib.rs"), "changed\n").expect("edit");
    let err = load(&pin, cache.path()).expect_err("refused");
    let msg = err.to_string();
    assert!(matches!(err, BaseError::CacheModified { .. }), "{msg}");
    assert!(msg.contains(&dir.display().to_string()) && msg.contains("modified: src/lib.rs"), "{msg}");
}

#[test]
fn a_truncated_or_bit_flipped_crate_is_refused_naming_the_file_and_nothing_is_unpacked() {
    for (name, damage) in [("fx-truncated", 0usize), ("fx-flipped", 1)] {
        let (pin, path) = publish(name);
        let mut bytes = fs::read(&path).expect("crate");
        if damage == 0 {
            bytes.truncate(bytes.len() / 2);
        } else {
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x10;
        }
        fs::write(&path, &bytes).expect("damage");
        let cache = tempfile::tempdir().expect("cache");
        let err = load(&pin, cache.path()).expect_err("refused");
        let msg = err.to_string();
        assert!(matches!(err, BaseError::CorruptCrate { .. }), "{name}: {msg}");
        assert!(msg.contains(&path.display().to_string()) && msg.contains(&tree::sha256_hex(&bytes)) && msg.contains(&pin.sha256), "{name}: {msg}");
        assert!(!cached_dir(&pin, cache.path()).exists(), "{name}: nothing unpacked");
    }
}

#[test]
fn a_cache_unpacked_without_a_recorded_manifest_is_checked_against_the_crate_once() {
    let (pin, _) = publish("fx-oldmarker");
    let cache = tempfile::tempdir().expect("cache");
    let good = load(&pin, cache.path()).expect("unpacks");
    let dir = cached_dir(&pin, cache.path());
    let marker = dir.join(".complete");
    // The marker an older version wrote: the first line only.
    let first = fs::read_to_string(&marker).expect("marker").lines().next().expect("line").to_owned();
    writable(&marker);
    fs::write(&marker, format!("{first}\n")).expect("old marker");
    writable(&dir.join("src/lib.rs"));
    fs::write(dir.join("src/lib.rs"), "changed\n").expect("edit");
    assert_eq!(load(&pin, cache.path()).expect("repaired"), good);
    assert!(fs::read_to_string(&marker).expect("marker").lines().count() > 1, "the marker now records the manifest");
}
