//! The progress table: every lesson's exercises with the outcome their graders recorded, and the
//! next exercise to do (what `cargo test` ends with and `cargo grade` prints).

use super::{exercise_number, exercises, record_dir, Status};
use std::fs;
use std::path::{Path, PathBuf};

/// The crate's own directory (where `lessons/` and `tests/` are).
pub fn crate_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Where the graders record outcomes: the integration tests' `CARGO_TARGET_TMPDIR`.
pub fn records_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| crate_root().join("target"));
    let target = if target.is_absolute() { target } else { crate_root().join(target) };
    target.join("tmp")
}

/// Grades your exercise file for lesson `nn` (as `cargo test` does: not started is not a failure)
/// and returns the lesson's exercises with their status and the grader's messages — what a
/// notebook's "grade my exercise" cell prints. Runs `cargo test --test lessonNN exercise::`, so
/// the first call compiles the grader (a minute or so).
pub fn grade(nn: &str) -> String {
    use std::fmt::Write;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .current_dir(crate_root())
        .args(["test", "--quiet", "--test", &format!("lesson{nn}"), "exercise::"])
        .env("SHARDLAB_NO_EXIT_TABLE", "1")
        // A notebook kernel may export LIBTORCH as an absolute path: let .cargo/config.toml set it,
        // as for plain `cargo test`, so the build is shared instead of redone.
        .env_remove("LIBTORCH")
        .output();
    let mut s = String::new();
    let out = match out {
        Ok(o) => o,
        Err(e) => return format!("cannot run cargo: {e}"),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("could not compile") {
        return format!("your exercise file does not compile:\n{stderr}");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let Some(l) = progress(crate_root(), &records_dir()).into_iter().find(|l| l.nn == nn) else {
        return format!("lesson {nn} has no exercises");
    };
    let _ = writeln!(s, "lesson {} — lessons/{}/exercise.rs:", l.nn, l.slug);
    for (k, fns, st) in &l.exercises {
        let _ = match st {
            Status::Done => writeln!(s, "  ex{k} `{}`: done", fns.join("`, `")),
            Status::NotStarted => writeln!(s, "  ex{k} `{}`: not started", fns.join("`, `")),
            Status::NotGraded => {
                writeln!(s, "  ex{k} `{}`: not graded (the grader's output is below)", fns.join("`, `"))
            }
            Status::Failing(m) => {
                writeln!(s, "  ex{k} `{}`: FAILING\n      {}", fns.join("`, `"), m.replace('\n', "\n      "))
            }
        };
    }
    if l.exercises.iter().any(|e| e.2 == Status::NotGraded) {
        let all: Vec<&str> = stdout.lines().chain(stderr.lines()).collect();
        let _ = writeln!(s, "\nthe grader's last output:");
        for line in &all[all.len().saturating_sub(30)..] {
            let _ = writeln!(s, "  {line}");
        }
    }
    s
}

/// One lesson as the progress table sees it.
#[derive(Clone, Debug)]
pub struct LessonProgress {
    pub nn: String,
    pub slug: String,
    /// `(exercise number, its functions, status)`.
    pub exercises: Vec<(usize, Vec<String>, Status)>,
}

/// Every lesson's exercises under `root` (the crate's directory), with the statuses recorded under
/// `tmp_dir` by the last grading. A record older than the exercise file counts as not graded.
pub fn progress(root: &Path, tmp_dir: &Path) -> Vec<LessonProgress> {
    let mut lessons: Vec<(String, String)> = fs::read_dir(root.join("lessons"))
        .map(|d| {
            d.filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                let nn = name.split_once('_')?.0.to_string();
                (nn.len() == 2 && nn.chars().all(|c| c.is_ascii_digit())).then_some((nn, name))
            })
            .collect()
        })
        .unwrap_or_default();
    lessons.sort();
    let mut out = Vec::new();
    for (nn, slug) in lessons {
        let file = root.join("lessons").join(&slug).join("exercise.rs");
        let Ok(src) = fs::read_to_string(&file) else { continue };
        let dir = record_dir(&tmp_dir.to_string_lossy(), &nn);
        let mut records: Vec<(String, String)> = Vec::new(); // (test, text)
        if let Ok(d) = fs::read_dir(&dir) {
            for e in d.flatten() {
                records.push((
                    e.file_name().to_string_lossy().to_string(),
                    fs::read_to_string(e.path()).unwrap_or_default(),
                ));
            }
        }
        let exercises = exercises(&src)
            .into_iter()
            .map(|ex| {
                let mine: Vec<&(String, String)> =
                    records.iter().filter(|r| exercise_number(&r.0) == Some(ex.number)).collect();
                // A record counts only if it graded this exercise's code as it is now.
                let current = format!("{:016x}", ex.fingerprint);
                let fresh = |r: &&(String, String)| r.1.lines().nth(1) == Some(current.as_str());
                let status = if ex.untouched {
                    Status::NotStarted
                } else if mine.is_empty() || !mine.iter().all(fresh) {
                    Status::NotGraded
                } else if let Some(f) = mine.iter().find(|r| r.1.starts_with("failing")) {
                    Status::Failing(f.1.splitn(3, '\n').nth(2).unwrap_or("").trim().to_string())
                } else if mine.iter().all(|r| r.1.starts_with("done")) {
                    Status::Done
                } else {
                    Status::NotGraded
                };
                (ex.number, ex.functions, status)
            })
            .collect();
        out.push(LessonProgress { nn, slug, exercises });
    }
    out
}

/// The progress table: one row per lesson, one column per exercise, and what to do next.
pub fn progress_table(lessons: &[LessonProgress]) -> String {
    use std::fmt::Write;
    let width = lessons.iter().map(|l| l.exercises.len()).max().unwrap_or(0);
    // The lesson column fits the longest slug (`09_activation_checkpointing`), so the marks line up.
    let name_width = lessons.iter().map(|l| l.slug.chars().count()).max().unwrap_or(0).max("lesson".len());
    let mut s = String::new();
    let _ = writeln!(s, "\nYour progress — lessons/NN_slug/exercise.rs, graded by `cargo test` and `cargo grade`:\n");
    let _ = write!(s, "  {:<name_width$}", "lesson");
    for k in 1..=width {
        let _ = write!(s, " ex{k:<3}");
    }
    let _ = writeln!(s);
    let (mut done, mut total) = (0, 0);
    // What to do next: the first failing exercise, else the first one changed since it was
    // graded, else the first not started.
    let mut next: [Option<(&LessonProgress, usize, &[String], &Status)>; 3] = [None, None, None];
    for l in lessons {
        let _ = write!(s, "  {:<name_width$}", l.slug);
        for (k, fns, st) in &l.exercises {
            total += 1;
            let (mark, rank) = match st {
                Status::Done => ("done", None),
                Status::Failing(_) => ("FAIL", Some(0)),
                Status::NotGraded => ("?", Some(1)),
                Status::NotStarted => ("·", Some(2)),
            };
            done += usize::from(*st == Status::Done);
            let _ = write!(s, " {mark:<5}");
            if let Some(r) = rank {
                next[r].get_or_insert((l, *k, fns, st));
            }
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(
        s,
        "\n  done: passes its grader   FAIL: attempted, failing   ?: changed since graded   ·: not started"
    );
    let _ = writeln!(s, "  {done} of {total} exercises done.");
    match next.iter().flatten().next() {
        None if total > 0 => {
            let _ = writeln!(s, "  Every exercise passes.");
        }
        None => {}
        Some(&(l, k, fns, st)) => {
            let what = match st {
                Status::Failing(_) => " fails",
                Status::NotGraded => " changed since it was graded",
                _ => "",
            };
            let _ = writeln!(s, "\n  Next: lesson {} exercise {k} (`{}`){what}.", l.nn, fns.join("`, `"));
            if let Status::Failing(m) = st {
                for line in m.lines().take(4) {
                    let _ = writeln!(s, "    {line}");
                }
            }
            let _ = writeln!(
                s,
                "  Edit lessons/{}/exercise.rs, then `cargo grade {} ex{k}`; stuck? `cargo grade {} --hint {k}`.",
                l.slug, l.nn, l.nn
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_columns_line_up_for_long_slugs() {
        let lesson = |nn: &str, slug: &str, n: usize| LessonProgress {
            nn: nn.into(),
            slug: slug.into(),
            exercises: (1..=n).map(|k| (k, vec![format!("f{k}")], Status::Done)).collect(),
        };
        let t = progress_table(&[
            lesson("01", "01_process_groups", 3),
            lesson("09", "09_activation_checkpointing", 4),
            lesson("10", "10_distributed_checkpoints", 4),
        ]);
        // The byte where a line's second column starts (the slugs and marks here are ASCII).
        let second_column = |first: &str| {
            let line = t.lines().find(|l| l.trim_start().starts_with(first)).expect(first);
            let after = line.find(first).unwrap() + first.len();
            after + line[after..].len() - line[after..].trim_start().len()
        };
        let header = second_column("lesson");
        for slug in ["01_process_groups", "09_activation_checkpointing", "10_distributed_checkpoints"] {
            assert_eq!(second_column(slug), header, "{slug}'s marks start under ex1:\n{t}");
        }
        assert!(t.contains("11 of 11 exercises done."), "{t}");
    }
}
