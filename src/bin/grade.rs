//! `cargo grade NN` — grade your exercise file for lesson NN.
//!
//! Runs `cargo test --features grade --test lessonNN`: the lesson's grader compiled against
//! `lessons/NN_slug/exercise.rs` instead of the reference answers in `solutions/`.

use std::path::Path;
use std::process::{exit, Command};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut lessons: Vec<String> = std::fs::read_dir(root.join("tests"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter_map(|n| n.strip_prefix("lesson")?.strip_suffix(".rs").map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    lessons.sort();
    let arg = std::env::args().nth(1).unwrap_or_default();
    let nn = match arg.trim_start_matches("lesson").parse::<u32>() {
        Ok(n) => format!("{n:02}"),
        Err(_) => {
            eprintln!("usage: cargo grade NN   (lessons with a grader: {})", lessons.join(", "));
            exit(2);
        }
    };
    if !lessons.contains(&nn) {
        eprintln!("lesson {nn} has no grader yet (lessons with a grader: {})", lessons.join(", "));
        exit(2);
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("grading lessons/{nn}_*/exercise.rs with tests/lesson{nn}.rs …");
    let status = Command::new(cargo)
        .current_dir(root)
        .args(["test", "--quiet", "--features", "grade", "--test", &format!("lesson{nn}")])
        .args(std::env::args().skip(2))
        .status()
        .unwrap_or_else(|e| {
            eprintln!("cannot run cargo: {e}");
            exit(2)
        });
    if status.success() {
        eprintln!("lesson {nn}: every exercise passes.");
    } else {
        eprintln!("lesson {nn}: not yet — read the failures above; hints are in lessons/{nn}_*/README.md.");
    }
    exit(status.code().unwrap_or(1));
}
