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

mod compare;
mod exercises;
mod progress;
mod torch_errors;

pub use compare::{assert_layout, layout_error, max_diff, memory, same_memory, Memory};
pub use exercises::{exercise_number, exercises, Exercise};
pub use progress::{crate_root, grade, progress, progress_table, records_dir, LessonProgress};

use exercises::exercise_at_line;
use std::fs;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Once;
pub use torch_errors::tidy_libtorch_error;
use torch_errors::{exercise_frame, LAST_TORCH_AT};

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

/// Is this an opt-in to strict grading (`SHARDLAB_GRADE=strict`)?
pub fn strict() -> bool {
    std::env::var("SHARDLAB_GRADE").map(|v| v == "strict").unwrap_or(false)
}

/// Refuse an exercise that calls shardlab's own copy of what it asks for: a panic ("write it
/// yourself") naming the first of `twins` (names or paths) found in the code of exercise `k`'s
/// section of the learner's file (from its `/// Exercise k` line to the next exercise's) or of
/// the lines before the first exercise (where a `use … as` would hide a twin), comments and
/// string literals aside. A name matches as a whole word; one written `.name` matches a method
/// call (`x.name(`), where the letter before the dot is the receiver's. Only the learner's copy
/// is checked (the reference answers call none).
pub fn refuse_twins(g: Grader, k: usize, twins: &[&str]) {
    refuse_names(g, k, twins, |t| {
        format!(
            "write it yourself: your exercise {k} names `{t}`, shardlab's own copy (or a library's) of what this \
             exercise asks you to build. (If `{t}` is a helper or variable of your own, rename it; the lines above \
             exercise 1 count for every exercise.)"
        )
    })
}

/// Refuse exercise `k`'s code if it names any of `names` (matched as [`refuse_twins`] does), with
/// the message `why(name)`: for what an exercise must not call (a test's own controls, say).
pub fn refuse_names(g: Grader, k: usize, names: &[&str], why: impl Fn(&str) -> String) {
    if g.who != Who::Exercise {
        return;
    }
    let src = fs::read_to_string(g.exercise_file).unwrap_or_default();
    let mut current = None;
    let mut kept = String::new();
    for line in src.lines() {
        if let Some(rest) = line.trim_start().strip_prefix("/// Exercise ") {
            current = rest.split(|c: char| !c.is_ascii_digit()).next().and_then(|n| n.parse::<usize>().ok());
        }
        if current.is_none() || current == Some(k) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    let code = exercises::strip_comments_and_strings(&kept);
    let word = |t: &str| {
        code.match_indices(t).any(|(i, _)| {
            let before =
                t.starts_with('.') || code[..i].chars().next_back().is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
            let after = code[i + t.len()..].chars().next().is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
            before && after
        })
    };
    if let Some(t) = names.iter().find(|t| word(t)) {
        panic!("{}", why(t));
    }
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
            if msg.contains("Torch(\"") {
                // The line a rank thread's libtorch error came from, if it is in this exercise.
                let at = LAST_TORCH_AT.lock().ok().and_then(|mut l| l.take()).filter(|a| {
                    let line = a.rsplit(':').next().and_then(|l| l.parse::<u32>().ok());
                    line.and_then(|l| exercise_at_line(&src, l)) == Some(number)
                });
                msg = tidy_libtorch_error(&msg, at.as_deref());
            }
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

/// The text of a panic's payload (a grader that catches a panic tells a `todo!()` from a failure).
pub fn payload_message(p: &(dyn std::any::Any + Send)) -> String {
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

/// Panics print the grader's message and where it was raised — no backtrace, whatever
/// `RUST_BACKTRACE` says (`SHARDLAB_BACKTRACE=1` restores Rust's default hook).
fn install_quiet_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var("SHARDLAB_BACKTRACE").map(|v| v == "1").unwrap_or(false) {
            return;
        }
        panic::set_hook(Box::new(|info| {
            let mut msg = payload_message(info.payload());
            let mut torch_at = None;
            if msg.contains("Torch(\"") {
                let at = exercise_frame();
                torch_at = at.clone();
                if let (Some(a), Ok(mut last)) = (&at, LAST_TORCH_AT.lock()) {
                    *last = Some(a.clone());
                }
                msg = tidy_libtorch_error(&msg, at.as_deref());
            }
            if msg.contains("not yet implemented") {
                if let (Some(l), Ok(mut last)) = (info.location(), LAST_TODO.lock()) {
                    *last = Some((l.file().to_string(), l.line()));
                }
            }
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("a thread");
            match info.location() {
                // The grader's own "not started" needs no location.
                Some(l) if l.file().contains("src/grading/") => eprintln!("{msg}"),
                // libtorch's panics are raised inside tch: say where in exercise.rs instead.
                _ if torch_at.is_some() => eprintln!("{msg}\n    (panicked in {name})"),
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
