//! The course's grading machinery: how `cargo test` grades your `lessons/NN_slug/exercise.rs`.
//!
//! Every lesson's grader (`tests/lessonNN.rs`) is written once, inside [`graders!`](crate::graders),
//! which compiles it twice: as `solution::…` against the reference answers in `solutions/`, and as
//! `exercise::…` against your exercise file. So `cargo test` prints lines such as
//!
//! ```text
//! test exercise::ex1_ring_segments_split_evenly_in_order ... ok
//! test solution::ex1_ring_segments_split_evenly_in_order ... ok
//! ```
//!
//! * An exercise whose functions are all still the untouched `todo!()` is **not started**: its tests
//!   are skipped (reported `ok`, recorded as not started), so a fresh clone passes `cargo test`.
//!   With `SHARDLAB_GRADE=strict` (what `cargo grade NN` sets) a not-started exercise fails.
//! * An attempted exercise runs its tests; a failure prints the grader's message, without a
//!   backtrace (set `SHARDLAB_BACKTRACE=1` to get Rust's usual panic output back).
//! * Each exercise test records its outcome under `target/tmp/grades/`; the last test target of
//!   `cargo test` (`tests/zz_progress.rs`) and `cargo grade` read them back into the
//!   [progress table](progress_table).
//!
//! An exercise is the part of `exercise.rs` from a doc comment `/// Exercise K — …` to the next
//! one; its tests are the grader's tests named `exK_…`.

use std::fs;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Once;

/// Which answers a compiled copy of a grader runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Who {
    /// `solutions/NN_slug.rs` — must always pass.
    Solution,
    /// `lessons/NN_slug/exercise.rs` — the learner's.
    Exercise,
}

/// What [`graders!`](crate::graders) hands to every test it wraps.
#[derive(Clone, Copy, Debug)]
pub struct Grader {
    pub who: Who,
    /// Two digits, e.g. `"03"`.
    pub lesson: &'static str,
    /// Absolute path of the learner's `exercise.rs`.
    pub exercise_file: &'static str,
    /// The test target's scratch directory (`CARGO_TARGET_TMPDIR`), where outcomes are recorded.
    pub tmp_dir: &'static str,
    /// The names of the grader's tests.
    pub tests: &'static [&'static str],
}

/// An exercise's state, as the progress table shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Done,
    NotStarted,
    /// With the grader's message.
    Failing(String),
    /// The file changed after the last grading (or it was never graded).
    NotGraded,
}

/// One exercise as found in an exercise file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exercise {
    pub number: usize,
    /// The functions of this exercise's section, in order.
    pub functions: Vec<String>,
    /// Every one of its `pub fn`s (the stubs) is still exactly `todo!()`; helpers the learner adds
    /// do not count.
    pub untouched: bool,
    /// A fingerprint of the section's code, to tell whether a grading is still current.
    pub fingerprint: u64,
}

/// Is this an opt-in to strict grading (`SHARDLAB_GRADE=strict`)?
pub fn strict() -> bool {
    std::env::var("SHARDLAB_GRADE").map(|v| v == "strict").unwrap_or(false)
}

/// The exercise number of a grader test: `ex3_ring_all_reduce…` → 3.
pub fn exercise_number(test: &str) -> Option<usize> {
    let rest = test.rsplit("::").next()?.strip_prefix("ex")?;
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// Runs one test of a grader. Called by the code [`graders!`](crate::graders) generates.
pub fn run(g: Grader, test: &str, body: impl FnOnce()) {
    install_quiet_hook();
    if g.who == Who::Solution {
        return body();
    }
    prune_stale_records(&g);
    let number = exercise_number(test).unwrap_or(0);
    let src = fs::read_to_string(g.exercise_file).unwrap_or_default();
    let ex = exercises(&src).into_iter().find(|e| e.number == number);
    if ex.as_ref().map_or(false, |e| e.untouched) {
        record(&g, test, &Status::NotStarted);
        if strict() {
            let names = ex.map(|e| e.functions.join("`, `")).unwrap_or_default();
            panic!(
                "not started: exercise {number} (`{names}`) in {} is still `todo!()`.\n\
                 Replace the todo!() and grade again; hints: `cargo grade {} --hint {number}`.",
                short_path(g.exercise_file),
                g.lesson
            );
        }
        return;
    }
    match panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(()) => record(&g, test, &Status::Done),
        Err(payload) => {
            let mut msg = payload_message(&*payload);
            if msg.contains("not yet implemented") {
                // Which todo!() fired: the hook kept the location of the last one.
                let at = LAST_TODO.lock().map(|l| l.clone()).unwrap_or(None);
                let (line, of) = match at {
                    Some((file, line)) if file.ends_with("exercise.rs") => (line, exercise_at_line(&src, line)),
                    _ => (0, None),
                };
                msg = match of {
                    Some(k) if k == number => format!(
                        "{msg}: line {line} of your exercise {number} is still `todo!()` — finish every function of it"
                    ),
                    Some(k) => format!(
                        "{msg}: this test of exercise {number} also runs your exercise {k}, whose `todo!()` at line \
                         {line} is not done yet — do exercise {k} first"
                    ),
                    None => format!("{msg}: a `todo!()` this test runs is not done yet"),
                };
            }
            record(&g, test, &Status::Failing(msg));
            table_at_exit(&g);
            panic::resume_unwind(payload)
        }
    }
}

/// A failing grader stops `cargo test` before `tests/zz_progress.rs` runs, so the failing test
/// binary prints the progress table itself as it exits.
fn table_at_exit(g: &Grader) {
    static PATHS: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    let root = g.exercise_file.rfind("/lessons/").map_or(".", |i| &g.exercise_file[..i]);
    // `cargo grade` prints its own table.
    if std::env::var_os("SHARDLAB_NO_EXIT_TABLE").is_some()
        || PATHS.set((PathBuf::from(root), PathBuf::from(g.tmp_dir))).is_err()
    {
        return;
    }
    extern "C" fn print_table() {
        let _ = panic::catch_unwind(|| {
            if let Some((root, tmp)) = PATHS.get() {
                use std::io::Write;
                let _ = write!(std::io::stdout(), "{}", progress_table(&progress(root, tmp)));
                let _ = std::io::stdout().flush();
            }
        });
    }
    // SAFETY: registers a plain function without arguments, run once by exit(3).
    unsafe { libc::atexit(print_table) };
}

fn short_path(p: &str) -> &str {
    p.find("lessons/").map_or(p, |i| &p[i..])
}

fn payload_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "the test panicked".into()
    }
}

/// Where the last `todo!()` panicked (file, line): rank threads panic away from the test thread.
static LAST_TODO: std::sync::Mutex<Option<(String, u32)>> = std::sync::Mutex::new(None);

/// The exercise whose section holds line `line` (1-based) of an exercise file.
fn exercise_at_line(src: &str, line: u32) -> Option<usize> {
    let mut current = None;
    for (i, l) in src.lines().enumerate() {
        current = exercise_header(l).or(current);
        if i + 1 == line as usize {
            return current;
        }
    }
    None
}

/// Panics print the grader's message and where it was raised — no backtrace, whatever
/// `RUST_BACKTRACE` says (`SHARDLAB_BACKTRACE=1` restores Rust's default hook).
fn install_quiet_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var("SHARDLAB_BACKTRACE").map(|v| v == "1").unwrap_or(false) {
            return;
        }
        panic::set_hook(Box::new(|info| {
            let msg = payload_message(info.payload());
            if msg.contains("not yet implemented") {
                if let (Some(l), Ok(mut last)) = (info.location(), LAST_TODO.lock()) {
                    *last = Some((l.file().to_string(), l.line()));
                }
            }
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("a thread");
            match info.location() {
                // The grader's own "not started" needs no location.
                Some(l) if l.file().ends_with("grading.rs") => eprintln!("{msg}"),
                Some(l) => {
                    eprintln!("{msg}\n    (panicked in {name} at {}:{})", l.file().replace("tests/../", ""), l.line())
                }
                None => eprintln!("{msg}\n    (panicked in {name})"),
            }
        }));
    });
}

fn record_dir(tmp_dir: &str, lesson: &str) -> PathBuf {
    Path::new(tmp_dir).join("grades").join(format!("lesson{lesson}"))
}

/// Records of tests this grader no longer has (renamed or removed) would show forever: remove
/// them, once per test process.
fn prune_stale_records(g: &Grader) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let dir = record_dir(g.tmp_dir, g.lesson);
        for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !g.tests.contains(&name.as_str()) {
                let _ = fs::remove_file(e.path());
            }
        }
    });
}

/// A record: the status, the fingerprint of the exercise's source it was graded on, the message.
fn record(g: &Grader, test: &str, status: &Status) {
    let dir = record_dir(g.tmp_dir, g.lesson);
    let _ = fs::create_dir_all(&dir);
    let name = test.rsplit("::").next().unwrap_or(test);
    let src = fs::read_to_string(g.exercise_file).unwrap_or_default();
    let print = exercise_number(name)
        .and_then(|k| exercises(&src).into_iter().find(|e| e.number == k))
        .map_or(0, |e| e.fingerprint);
    let text = match status {
        Status::Done => format!("done\n{print:016x}\n"),
        Status::NotStarted => format!("not-started\n{print:016x}\n"),
        Status::Failing(m) => format!("failing\n{print:016x}\n{m}"),
        Status::NotGraded => return,
    };
    let _ = fs::write(dir.join(name), text);
}

/// FNV-1a of the exercise's code without comments and whitespace: an edit of a comment or of
/// another exercise leaves it alone.
fn fingerprint(code: &str) -> u64 {
    code.bytes()
        .filter(|b| !b.is_ascii_whitespace())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// K if `line` opens exercise K's section (`/// Exercise K — …`).
fn exercise_header(line: &str) -> Option<usize> {
    let rest = line.trim_start().strip_prefix("/// Exercise ")?;
    rest.chars().take_while(|c| c.is_ascii_digit()).collect::<String>().parse().ok()
}

/// The exercises of an exercise file, from its `/// Exercise K` sections.
pub fn exercises(src: &str) -> Vec<Exercise> {
    let mut starts: Vec<(usize, usize)> = Vec::new(); // (byte offset, number)
    let mut offset = 0;
    for line in src.split_inclusive('\n') {
        if let Some(k) = exercise_header(line) {
            starts.push((offset, k));
        }
        offset += line.len();
    }
    let mut out = Vec::new();
    for (i, &(at, number)) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(src.len(), |s| s.0);
        let code = strip_comments_and_strings(&src[at..end]);
        let fns: Vec<(String, String)> = functions(&code)
            .into_iter()
            .filter(|(n, _)| n.starts_with("pub "))
            .map(|(n, b)| (n[4..].to_string(), b))
            .collect();
        let untouched = !fns.is_empty() && fns.iter().all(|(_, body)| body == "todo!()");
        out.push(Exercise {
            number,
            functions: fns.into_iter().map(|(n, _)| n).collect(),
            untouched,
            fingerprint: fingerprint(&code),
        });
    }
    out
}

/// Replaces comments with nothing and the insides of string and char literals with `_`, so that
/// braces and `//` inside them do not confuse [`functions`].
fn strip_comments_and_strings(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            out.push('"');
            i += 1;
        } else if c == '\'' && b.get(i + 2) == Some(&'\'') {
            out.push_str("'_'");
            i += 3;
        } else if c == '\'' && next == Some('\\') {
            // An escaped char literal such as '\n' or '\u{7b}'.
            let close = (i + 2..b.len()).find(|&j| b[j] == '\'').unwrap_or(b.len() - 1);
            out.push_str("'_'");
            i = close + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `(name, body without whitespace)` of every `fn` with a body in already-stripped code.
fn functions(code: &str) -> Vec<(String, String)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(found) = code[i..].find("fn ") {
        let at = i + found;
        i = at + 3;
        let word_start = at == 0 || !(b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_');
        if !word_start {
            continue;
        }
        let name: String = code[i..].trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        // `pub fn` (also `pub(crate) fn`): the stubs' functions; private ones are the learner's helpers.
        let before = code[..at].trim_end();
        let name = if before.ends_with("pub") || before.ends_with(')') && before.contains("pub(") {
            format!("pub {name}")
        } else {
            name
        };
        // The body opens at the first `{` outside parentheses; a `;` first means no body.
        let mut depth = 0i32;
        let mut open = None;
        for (j, &c) in b.iter().enumerate().skip(i) {
            match c {
                b'(' | b'[' => depth += 1,
                b')' | b']' => depth -= 1,
                b';' if depth == 0 => break,
                b'{' if depth == 0 => {
                    open = Some(j);
                    break;
                }
                _ => {}
            }
        }
        let Some(open) = open else { continue };
        let mut level = 0;
        let mut close = b.len();
        for (j, &c) in b.iter().enumerate().skip(open) {
            if c == b'{' {
                level += 1;
            } else if c == b'}' {
                level -= 1;
                if level == 0 {
                    close = j;
                    break;
                }
            }
        }
        let body: String = code[open + 1..close.min(code.len())].chars().filter(|c| !c.is_whitespace()).collect();
        out.push((name, body));
        i = close.min(code.len());
    }
    out
}

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

/// Writes a lesson's grader once and compiles it twice: `solution::…` against `solution_code`
/// (the reference answers) and `exercise::…` against `exercise_code` (the learner's file). The test
/// file declares those two modules with `#[path]`, then:
///
/// ```text
/// shardlab::graders! {
///     lesson: "03", exercise_file: "lessons/03_allreduce_family/exercise.rs";
///
///     fn helper() { /* any items: helpers, uses, consts */ }
///
///     #[test]
///     fn ex1_ring_segments_split_evenly() { /* asserts */ }
/// }
/// ```
///
/// Tests (`#[test] fn exK_…()`, optionally with doc comments) are wrapped in [`run`].
#[macro_export]
macro_rules! graders {
    (lesson: $lesson:literal, exercise_file: $file:literal; $($items:tt)*) => {
        $crate::graders!(@module solution, Solution, solution_code, $lesson, $file,
            "The grader run against the reference answers in `solutions/`."; $($items)*);
        $crate::graders!(@module exercise, Exercise, exercise_code, $lesson, $file,
            "The same grader run against your exercise file."; $($items)*);
    };
    (@module $module:ident, $who:ident, $code:ident, $lesson:literal, $file:literal, $doc:literal; $($items:tt)*) => {
        #[doc = $doc]
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            #[allow(unused_imports)]
            use super::$code::*;
            #[allow(dead_code)]
            const GRADER: $crate::grading::Grader = $crate::grading::Grader {
                who: $crate::grading::Who::$who,
                lesson: $lesson,
                exercise_file: concat!(env!("CARGO_MANIFEST_DIR"), "/", $file),
                tmp_dir: env!("CARGO_TARGET_TMPDIR"),
                tests: TESTS,
            };
            $crate::graders!(@items [] [] $($items)*);
        }
    };
    (@items [$($done:tt)*] [$($names:tt)*] $(#[doc = $doc:tt])* #[test] fn $name:ident() $body:block $($rest:tt)*) => {
        $crate::graders!(@items [$($done)*
            $(#[doc = $doc])*
            #[test]
            fn $name() {
                $crate::grading::run(GRADER, concat!(module_path!(), "::", stringify!($name)), || $body)
            }
        ] [$($names)* stringify!($name),] $($rest)*);
    };
    (@items [$($done:tt)*] [$($names:tt)*] $(#[doc = $doc:tt])* #[test] $($rest:tt)*) => {
        compile_error!(
            "graders!: write each test as `#[test] fn exK_name() { … }` — doc comments may come before \
             #[test]; other attributes and return types are not supported"
        );
    };
    (@items [$($done:tt)*] [$($names:tt)*] $item:item $($rest:tt)*) => {
        $crate::graders!(@items [$($done)* $item] [$($names)*] $($rest)*);
    };
    (@items [$($done:tt)*] [$($names:tt)*]) => {
        $($done)*
        /// This grader's tests (records of other names are stale: a renamed test's).
        const TESTS: &[&str] = &[$($names)*];
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    const STUB: &str = r#"
//! A file.
use x::y;

/// Exercise 1 — first.
pub fn a(x: usize) -> (Vec<usize>, Vec<usize>) {
    // TODO: do { it }.
    todo!()
}

/// Exercise 2 — second, two functions.
pub fn b<T: Into<u8>>(t: T) -> Result<(), String>
where
    T: Copy,
{
    todo!()
}
pub fn c() -> &'static str {
    /* nothing { yet */ todo!()
}
"#;

    #[test]
    fn finds_sections_and_untouched_bodies() {
        let ex = exercises(STUB);
        assert_eq!(ex.len(), 2);
        assert_eq!((ex[0].number, &ex[0].functions, ex[0].untouched), (1, &vec!["a".to_string()], true));
        assert_eq!(
            (ex[1].number, &ex[1].functions, ex[1].untouched),
            (2, &vec!["b".to_string(), "c".to_string()], true)
        );
        // A helper the learner adds below the last exercise does not start it.
        let helper = format!("{STUB}\nfn my_helper(x: usize) -> usize {{ x + 1 }}\n");
        let ex = exercises(&helper);
        assert!(ex[1].untouched, "a private helper is not a stub");
        assert_ne!(ex[1].fingerprint, exercises(STUB)[1].fingerprint, "but it changes the section's code");
        assert_eq!(ex[0].fingerprint, exercises(STUB)[0].fingerprint, "exercise 1 did not change");
        assert_eq!(exercise_at_line(STUB, 8), Some(1));
        assert_eq!(exercise_at_line(STUB, 18), Some(2));
    }

    #[test]
    fn any_edit_of_a_body_starts_the_exercise() {
        let started = STUB.replace("    /* nothing { yet */ todo!()", "    let s = \"}{\"; let c = '}'; todo!()");
        let ex = exercises(&started);
        assert!(ex[0].untouched);
        assert!(!ex[1].untouched, "c's body changed, so exercise 2 is started");
        let done = STUB.replacen("todo!()\n}", "(vec![], vec![])\n}", 1);
        assert!(!exercises(&done)[0].untouched);
    }

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

    #[test]
    fn test_names_map_to_exercises() {
        assert_eq!(exercise_number("exercise::ex3_ring_all_reduce"), Some(3));
        assert_eq!(exercise_number("ex12_x"), Some(12));
        assert_eq!(exercise_number("layout"), None);
    }
}
