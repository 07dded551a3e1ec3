//! `cargo grade` — your progress through the course, and one lesson's grader at a time.
//!
//! ```text
//! cargo grade                 grade every lesson's exercise file; print the progress table
//! cargo grade 03              grade lesson 03 strictly (an exercise not started fails)
//! cargo grade 03 ex2          only exercise 2 of lesson 03
//! cargo grade 03 --hint 2     the next hint for exercise 2 (run again for the one after)
//! cargo grade 03 --hint 2 1   hints of exercise 2 up to the first (start over)
//! cargo grade --watch         re-grade a lesson each time you save its exercise.rs, as `cargo
//!                             test` does (an exercise not started is not a failure)
//! ```
//!
//! Grading is `cargo test --test lessonNN exercise::…`: the lesson's grader (`tests/lessonNN.rs`)
//! compiled against your `lessons/NN_slug/exercise.rs` (see `shardlab::grading`). Plain `cargo
//! test` grades the same exercises, leniently: not started is not a failure there.

use shardlab::grading::{self, Status};
use std::path::{Path, PathBuf};
use std::process::{exit, Command, Stdio};
use std::time::Duration;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tmp_dir() -> PathBuf {
    grading::records_dir()
}

/// `(NN, slug)` of every lesson with a grader.
fn lessons() -> Vec<(String, String)> {
    grading::progress(root(), &tmp_dir())
        .into_iter()
        .filter(|l| root().join(format!("tests/lesson{}.rs", l.nn)).is_file())
        .map(|l| (l.nn, l.slug))
        .collect()
}

fn usage() -> ! {
    eprintln!(
        "usage: cargo grade [NN [exK] | NN --hint K [LEVEL] | --watch]\n  lessons with a grader: {}",
        lessons().iter().map(|l| l.0.as_str()).collect::<Vec<_>>().join(", ")
    );
    exit(2)
}

fn lesson_arg(arg: &str) -> String {
    let nn = match arg.trim_start_matches("lesson").parse::<u32>() {
        Ok(n) => format!("{n:02}"),
        Err(_) => usage(),
    };
    if !lessons().iter().any(|l| l.0 == nn) {
        eprintln!("lesson {nn} has no grader yet");
        usage();
    }
    nn
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    match a.as_slice() {
        [] => {
            let ok = grade_all();
            print_table();
            exit(if ok { 0 } else { 1 });
        }
        ["--watch"] => watch(),
        [nn, "--hint", k] | ["--hint", k, nn] => {
            hint(&lesson_arg(nn), k.trim_start_matches("ex").parse().unwrap_or_else(|_| usage()), None)
        }
        [nn, "--hint", k, level] => hint(
            &lesson_arg(nn),
            k.trim_start_matches("ex").parse().unwrap_or_else(|_| usage()),
            Some(level.parse().unwrap_or_else(|_| usage())),
        ),
        [nn] => exit(grade_lesson(&lesson_arg(nn), None, true)),
        [nn, ex] if ex.starts_with("ex") && ex[2..].parse::<usize>().is_ok() => {
            let (nn, k) = (lesson_arg(nn), ex[2..].parse().unwrap());
            let known: Vec<usize> = grading::progress(root(), &tmp_dir())
                .into_iter()
                .find(|l| l.nn == nn)
                .map(|l| l.exercises.iter().map(|e| e.0).collect())
                .unwrap_or_default();
            if !known.contains(&k) {
                eprintln!("lesson {nn} has no exercise {k} (its exercises: {known:?})");
                exit(2);
            }
            exit(grade_lesson(&nn, Some(k), true))
        }
        _ => usage(),
    }
}

/// Every lesson's exercises, leniently (as `cargo test` does), output kept back: the table says it.
fn grade_all() -> bool {
    let mut c = cargo();
    c.args(["test", "--quiet", "--no-fail-fast"]);
    for (nn, _) in lessons() {
        c.args(["--test", &format!("lesson{nn}")]);
    }
    c.args(["exercise::"]).env("SHARDLAB_NO_EXIT_TABLE", "1");
    eprintln!("grading every lesson's exercise.rs …");
    let out = c.output().unwrap_or_else(|e| {
        eprintln!("cannot run cargo: {e}");
        exit(2)
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("could not compile") {
        eprintln!("{stderr}\nan exercise file does not compile: fix the errors above, then grade again.");
        exit(1);
    }
    out.status.success()
}

fn print_table() {
    print!("{}", grading::progress_table(&grading::progress(root(), &tmp_dir())));
}

/// One lesson (or one exercise of it); `strict`: not started fails, else (as `cargo test` and
/// `--watch` grade) an exercise not started is skipped. Returns the exit code.
fn grade_lesson(nn: &str, ex: Option<usize>, strict: bool) -> i32 {
    let filter = match ex {
        Some(k) => format!("exercise::ex{k}_"),
        None => "exercise::".into(),
    };
    let what = ex.map_or(String::new(), |k| format!(" exercise {k}"));
    eprintln!("grading lesson {nn}{what} (lessons/{nn}_*/exercise.rs, tests/lesson{nn}.rs) …");
    let mut c = cargo();
    c.args(["test", "--quiet", "--test", &format!("lesson{nn}"), &filter]);
    if strict {
        c.env("SHARDLAB_GRADE", "strict");
    } else {
        c.env_remove("SHARDLAB_GRADE");
    }
    let status = c.env("SHARDLAB_NO_EXIT_TABLE", "1").stdout(Stdio::inherit()).status().unwrap_or_else(|e| {
        eprintln!("cannot run cargo: {e}");
        exit(2)
    });
    let progress = grading::progress(root(), &tmp_dir());
    let mut not_started = 0;
    if let Some(l) = progress.iter().find(|l| l.nn == nn) {
        println!("\nlesson {nn} ({}):", l.slug);
        for (k, fns, st) in &l.exercises {
            if ex.map_or(true, |e| e == *k) {
                let mark = match st {
                    Status::Done => "done",
                    Status::Failing(_) => "FAIL",
                    Status::NotStarted => "not started",
                    Status::NotGraded => "not graded (does it compile?)",
                };
                not_started += usize::from(*st == Status::NotStarted);
                println!("  ex{k} {:<28} {mark}", format!("`{}`", fns.join("`, `")));
            }
        }
    }
    if status.success() && !strict && not_started > 0 {
        println!("\nlesson {nn}: every exercise you started passes ({not_started} not started yet).");
    } else if status.success() {
        println!("\nlesson {nn}{what}: passes.");
    } else {
        let k = ex.map_or("K".to_string(), |k| k.to_string());
        println!(
            "\nlesson {nn}{what}: not yet — the grader's messages are above; `cargo grade {nn} --hint {k}` for a hint."
        );
    }
    status.code().unwrap_or(1)
}

/// Prints the hints for exercise `k` of lesson `nn`, one more each time (from the lesson's
/// `hints.md`: the `<details><summary>Hint …</summary>…</details>` blocks under `### K.`; the
/// README does not print them).
fn hint(nn: &str, k: usize, level: Option<usize>) -> ! {
    let slug = lessons().into_iter().find(|l| l.0 == nn).map(|l| l.1).unwrap();
    let text = std::fs::read_to_string(root().join(format!("lessons/{slug}/hints.md"))).unwrap_or_default();
    let hints = hints(&text, k);
    if hints.is_empty() {
        eprintln!("lesson {nn} has no hints for exercise {k} (see lessons/{slug}/hints.md)");
        exit(2);
    }
    let state = tmp_dir().join("grades").join("hints").join(format!("{nn}-{k}"));
    let seen: usize = std::fs::read_to_string(&state).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
    // An explicit level shows hints up to it (and sets the count there): `--hint K 1` starts over.
    let level = level.unwrap_or(seen + 1).clamp(1, hints.len());
    let _ = std::fs::create_dir_all(state.parent().unwrap());
    let _ = std::fs::write(&state, level.to_string());
    println!("lesson {nn}, exercise {k} — hint {level} of {}:\n", hints.len());
    for (i, h) in hints.iter().enumerate().take(level) {
        println!("  {}. {}\n", i + 1, h.replace('\n', "\n     "));
    }
    if level < hints.len() {
        println!("(run it again for hint {}; `cargo grade {nn} --hint {k} 1` starts over)", level + 1);
    } else {
        println!("(that was the last one; the reference answer is solutions/{slug}.rs)");
    }
    exit(0)
}

/// The hint texts of exercise `k` in a lesson's `hints.md`, as plain text.
fn hints(text: &str, k: usize) -> Vec<String> {
    let head = format!("### {k}.");
    let Some(start) = text.find(&head) else { return vec![] };
    let section = &text[start + head.len()..];
    let end = section.find("\n### ").or_else(|| section.find("\n## ")).unwrap_or(section.len());
    let mut out = Vec::new();
    let mut rest = &section[..end];
    while let Some(i) = rest.find("<details><summary>") {
        rest = &rest[i..];
        let Some(body_at) = rest.find("</summary>") else { break };
        let Some(close) = rest.find("</details>") else { break };
        out.push(html_to_text(&rest[body_at + "</summary>".len()..close]));
        rest = &rest[close..];
    }
    out
}

fn html_to_text(h: &str) -> String {
    let h = h.replace("<code>", "`").replace("</code>", "`");
    let mut out = String::new();
    let mut in_tag = false;
    for c in h.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if !in_tag => out.push(c),
            _ => {}
        }
    }
    let out = out.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&amp;", "&");
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Re-grades a lesson each time its `exercise.rs` is saved.
fn watch() -> ! {
    use notify::{RecursiveMode, Watcher};
    let (tx, rx) = std::sync::mpsc::channel();
    let mut watcher = notify::recommended_watcher(tx).unwrap_or_else(|e| {
        eprintln!("cannot watch files: {e}");
        exit(2)
    });
    watcher.watch(&root().join("lessons"), RecursiveMode::Recursive).unwrap_or_else(|e| {
        eprintln!("cannot watch lessons/: {e}");
        exit(2)
    });
    print_table();
    println!(
        "\nwatching lessons/*/exercise.rs — save one to grade its lesson as `cargo test` does: an exercise not \
         started is not a failure (`cargo grade NN` grades strictly). Ctrl-C stops."
    );
    loop {
        let Ok(first) = rx.recv() else { exit(0) };
        // Editors write in bursts (temporary file, rename, touch): collect a quiet 300 ms.
        let mut events = vec![first];
        while let Ok(e) = rx.recv_timeout(Duration::from_millis(300)) {
            events.push(e);
        }
        let mut changed: Vec<String> = events
            .into_iter()
            .flatten()
            .filter(|e| e.kind.is_modify() || e.kind.is_create())
            .flat_map(|e| e.paths)
            .filter(|p| p.file_name().is_some_and(|n| n == "exercise.rs"))
            .filter_map(|p| {
                let slug = p.parent()?.file_name()?.to_string_lossy().to_string();
                Some(slug.split_once('_')?.0.to_string())
            })
            .collect();
        changed.sort();
        changed.dedup();
        for nn in changed {
            if lessons().iter().any(|l| l.0 == nn) {
                println!("\n──────── lessons/{nn}_*/exercise.rs changed ────────");
                grade_lesson(&nn, None, false);
                println!("\nwatching — save again to re-grade (Ctrl-C stops).");
            }
        }
    }
}
