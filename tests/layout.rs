//! The course's shape: every lesson has all its parts under one slug, and the shipped stubs and
//! the reference answers are twins (same public signatures; stubs are `todo!()` with a `// TODO:`).
//!
//! These tests check the course's own files, never a learner's work: an exercise file is the
//! learner's to edit (it may hold anything that compiles, and only its grader judges it), so the
//! checks of the stubs themselves run only with `SHARDLAB_LAYOUT=shipped` — what CI sets on its
//! clean clone, where every exercise file must be the untouched stubs.

use std::fs;
use std::path::Path;

fn lessons() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut v: Vec<(String, String)> = fs::read_dir(root.join("lessons"))
        .unwrap()
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let nn = name.split_once('_')?.0.to_string();
            (nn.len() == 2 && nn.chars().all(|c| c.is_ascii_digit())).then_some((nn, name))
        })
        .collect();
    v.sort();
    v
}

/// The signatures of the `pub fn`s that open a line, whitespace-normalised, up to the opening
/// brace of the body.
fn signatures(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find("\npub fn ") {
        let tail = &rest[i + 1..];
        let end = tail.find('{').expect("fn without body");
        out.push(tail[..end].split_whitespace().collect::<Vec<_>>().join(" ").replace("( ", "(").replace(", )", ")"));
        rest = &tail[end..];
    }
    out
}

#[test]
fn every_lesson_has_all_its_parts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let all = lessons();
    assert!(!all.is_empty(), "no lessons found");
    for (nn, slug) in all {
        if nn == "00" {
            // The map: a text and a demo that measures every strategy; no exercises.
            for part in [format!("lessons/{slug}/README.md"), format!("src/bin/lesson{nn}.rs")] {
                assert!(root.join(&part).is_file(), "lesson {nn}: missing {part}");
            }
            continue;
        }
        for part in [
            format!("lessons/{slug}/README.md"),
            format!("lessons/{slug}/exercise.rs"),
            format!("solutions/{slug}.rs"),
            format!("tests/lesson{nn}.rs"),
            format!("src/bin/lesson{nn}.rs"),
            format!("notebooks/{slug}.ipynb"),
        ] {
            assert!(root.join(&part).is_file(), "lesson {nn}: missing {part}");
        }
    }
}

/// Does this checkout promise the shipped stubs (`SHARDLAB_LAYOUT=shipped`, set by CI on its clean
/// clone)? Without it the exercise files may hold a learner's work, which only the graders judge.
fn shipped() -> bool {
    std::env::var("SHARDLAB_LAYOUT").map(|v| v == "shipped").unwrap_or(false)
}

/// Each stub's body: the text between a line's `pub fn …{` and the next line that is just `}`.
fn stub_bodies(src: &str) -> Vec<&str> {
    src.split("\npub fn ").skip(1).map(|f| f.split_once('{').map_or("", |b| b.1).split("\n}").next().unwrap()).collect()
}

#[test]
fn stubs_and_solutions_are_twins() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (nn, slug) in lessons().into_iter().filter(|(nn, _)| nn != "00") {
        let sol = fs::read_to_string(root.join(format!("solutions/{slug}.rs"))).unwrap();
        assert!(!sol.contains("todo!()"), "lesson {nn}: the solution still has a todo!()");
        if shipped() {
            let stub = fs::read_to_string(root.join(format!("lessons/{slug}/exercise.rs"))).unwrap();
            let (a, b) = (signatures(&stub), signatures(&sol));
            assert!(!a.is_empty(), "lesson {nn}: the exercise file has no pub fn");
            assert_eq!(a, b, "lesson {nn}: exercise and solution signatures differ");
            let exercises = shardlab::grading::exercises(&stub);
            assert!(
                exercises.iter().all(|e| e.untouched)
                    && exercises.iter().map(|e| e.functions.len()).sum::<usize>() == a.len(),
                "lesson {nn}: every pub fn of the exercise file is a stub of an `/// Exercise K` section, still `todo!()`"
            );
            for (sig, body) in a.iter().zip(stub_bodies(&stub)) {
                let todos = body.lines().filter(|l| l.trim() == "todo!()").count();
                assert_eq!(todos, 1, "lesson {nn}: `{sig}`: the stub's body is one `todo!()` on its own line");
                assert!(body.contains("// TODO:"), "lesson {nn}: `{sig}`: the stub says what to do (// TODO:)");
            }
        }
        let grader = fs::read_to_string(root.join(format!("tests/lesson{nn}.rs"))).unwrap();
        assert!(
            grader.contains(&format!("../solutions/{slug}.rs"))
                && grader.contains(&format!("../lessons/{slug}/exercise.rs")),
            "lesson {nn}: the grader must include both the solution and the exercise (shardlab::graders!)"
        );
    }
}
