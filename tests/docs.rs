//! Text that cannot drift: every command the README, the lesson texts and the notebooks quote
//! (`cargo run --bin X -- flags`, `cargo grade …`, `cargo test --test X`) names a target that
//! exists, and every bin accepts the flags and values quoted — checked by running the bin itself
//! with those arguments and `--help` (clap rejects an unknown flag or value before it prints help).
//! Placeholders in upper case (`--world-size N`) are checked as flags only.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Markdown sources: the README, every lesson text and reference page, every notebook's markdown.
fn documents() -> Vec<(PathBuf, String)> {
    let mut out = vec![(root().join("README.md"), fs::read_to_string(root().join("README.md")).unwrap())];
    let mut stack = vec![root().join("lessons")];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push((p.clone(), fs::read_to_string(&p).unwrap()));
            }
        }
    }
    for e in fs::read_dir(root().join("notebooks")).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "ipynb") {
            let nb: serde_json::Value = serde_json::from_str(&fs::read_to_string(&p).unwrap()).unwrap();
            let mut text = String::new();
            for cell in nb["cells"].as_array().into_iter().flatten() {
                let src = &cell["source"];
                let s = match src {
                    serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect::<String>(),
                    other => other.as_str().unwrap_or("").to_string(),
                };
                text.push_str(&s);
                text.push('\n');
            }
            out.push((p, text));
        }
    }
    out
}

/// `cargo …` commands quoted in `text`: inline code spans and lines of code blocks (a trailing
/// `\` continues a line; `# comments` and env assignments before `cargo` are dropped).
fn commands(text: &str) -> Vec<String> {
    let joined = text.replace("\\\n", " ");
    // Code only: whole lines inside fenced blocks, inline `code spans` elsewhere.
    let mut code: Vec<String> = Vec::new();
    let mut fenced = false;
    for line in joined.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            code.push(line.to_string());
        } else {
            code.extend(line.split('`').skip(1).step_by(2).map(str::to_string));
        }
    }
    let mut found = Vec::new();
    for line in &code {
        let mut rest = line.as_str();
        while let Some(i) = rest.find("cargo ") {
            let start = &rest[i..];
            let end = start.find(['`', '|', '#', '"', ')', ';', '>', '&']).unwrap_or(start.len());
            let cmd = start[..end].split_whitespace().collect::<Vec<_>>().join(" ");
            found.push(cmd);
            rest = &start[end.max(6)..];
        }
    }
    found
}

fn bin_path(name: &str) -> PathBuf {
    // Integration tests live in target/<profile>/deps; cargo builds the package's bins next to it.
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join(name)
}

fn is_placeholder(tok: &str) -> bool {
    tok.contains(['<', '…', '[', '{', '$'])
        || tok.chars().all(|c| c.is_ascii_uppercase() || c == '_' || c == ',' || c.is_ascii_digit())
            && tok.chars().any(|c| c.is_ascii_uppercase())
            && !tok.chars().last().is_some_and(|c| c == 'K' || c == 'M') // sizes such as 4K, 64M
}

#[test]
fn every_quoted_command_exists_and_accepts_its_flags() {
    // Cargo's bins: src/bin/NAME.rs and src/bin/NAME/main.rs.
    let bins: BTreeSet<String> = fs::read_dir(root().join("src/bin"))
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().to_str()?.to_string();
            match name.strip_suffix(".rs") {
                Some(stem) => Some(stem.to_string()),
                None => e.path().join("main.rs").is_file().then_some(name),
            }
        })
        .collect();
    let tests: BTreeSet<String> = fs::read_dir(root().join("tests"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".rs").map(str::to_string))
        .collect();
    let lessons: BTreeSet<String> =
        (0..100).map(|n| format!("{n:02}")).filter(|nn| tests.contains(&format!("lesson{nn}"))).collect();
    let mut bad = Vec::new();
    let mut checked = 0;
    // (file, command, bin, arguments) of every `cargo run --bin`; each distinct (bin, arguments)
    // is run once, below, on a few threads (every run loads libtorch: about a second).
    let mut runs: Vec<(String, String, String, Vec<String>)> = Vec::new();
    for (path, text) in documents() {
        let file = path.strip_prefix(root()).unwrap_or(&path).display().to_string();
        for cmd in commands(&text) {
            let toks: Vec<&str> = cmd.split_whitespace().collect();
            match toks.get(1).copied() {
                Some("run") => {
                    let Some(bi) = toks.iter().position(|&t| t == "--bin") else { continue };
                    let Some(&name) = toks.get(bi + 1) else { continue };
                    if is_placeholder(name) || name.starts_with("lessonNN") {
                        continue;
                    }
                    if !bins.contains(name) {
                        bad.push(format!("{file}: `{cmd}`: there is no bin `{name}`"));
                        continue;
                    }
                    let args: Vec<&str> = match toks.iter().position(|&t| t == "--") {
                        Some(i) => toks[i + 1..].to_vec(),
                        None => vec![],
                    };
                    checked += 1;
                    runs.push((
                        file.clone(),
                        cmd.clone(),
                        name.to_string(),
                        args.iter().map(|a| a.to_string()).collect(),
                    ));
                }
                Some("grade") => {
                    if let Some(nn) = toks.get(2).filter(|t| t.chars().all(|c| c.is_ascii_digit())) {
                        checked += 1;
                        if !lessons.contains(*nn) {
                            bad.push(format!("{file}: `{cmd}`: lesson {nn} has no grader"));
                        }
                    }
                }
                Some("test") => {
                    if let Some(i) = toks.iter().position(|&t| t == "--test") {
                        if let Some(&t) = toks.get(i + 1) {
                            checked += 1;
                            if !is_placeholder(t) && !t.contains("NN") && !tests.contains(t) {
                                bad.push(format!("{file}: `{cmd}`: there is no test target `{t}`"));
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let distinct: Vec<(&str, &[String])> = runs
        .iter()
        .map(|(_, _, name, args)| (name.as_str(), args.as_slice()))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::collections::BTreeMap<(&str, &[String]), Result<(), String>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(name, args)) = distinct.get(i) else { break mine };
                        let args: Vec<&str> = args.iter().map(String::as_str).collect();
                        mine.push(((name, distinct[i].1), check_bin_args(name, &args)));
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    for (file, cmd, name, args) in &runs {
        if let Err(e) = &results[&(name.as_str(), args.as_slice())] {
            bad.push(format!("{file}: `{cmd}`: {e}"));
        }
    }
    assert!(checked > 20, "found only {checked} commands to check: is the extraction broken?");
    assert!(
        distinct.len() > 20,
        "found only {} distinct `cargo run --bin` commands: is the extraction broken?",
        distinct.len()
    );
    assert!(bad.is_empty(), "commands quoted in the texts that would not run as written:\n{}", bad.join("\n"));
}

/// Runs the bin with `args` and `--help`: exit 0 if clap accepts every flag and value. Placeholder
/// values are left out (their flag is then checked against the help text).
fn check_bin_args(name: &str, args: &[&str]) -> Result<(), String> {
    let mut real = Vec::new();
    let mut flags_only = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = args[i];
        let next = args.get(i + 1).copied();
        if a.starts_with("--") && next.is_some_and(is_placeholder) {
            flags_only.push(a.split('=').next().unwrap().to_string());
            i += 2;
            continue;
        }
        if is_placeholder(a) {
            i += 1;
            continue;
        }
        real.push(a.to_string());
        i += 1;
    }
    let out = Command::new(bin_path(name))
        .args(&real)
        .arg("--help")
        .output()
        .map_err(|e| format!("cannot run {name}: {e}"))?;
    let help = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!("{name} rejects these arguments: {}", err.lines().next().unwrap_or("")));
    }
    for f in flags_only {
        if !help.contains(&format!("{f} ")) && !help.contains(&format!("{f}\n")) && !help.contains(&format!("{f}=")) {
            return Err(format!("{name} has no flag {f}"));
        }
    }
    Ok(())
}

/// The lines between `// listing: begin` and `// listing: end` of a compiled file, dedented.
fn listing(path: &str) -> Option<String> {
    let src = fs::read_to_string(root().join(path)).ok()?;
    let body = src.split_once("// listing: begin\n")?.1.split_once("// listing: end")?.0;
    let indent = body.lines().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min()?;
    Some(
        body.lines()
            .map(|l| l.get(indent..).unwrap_or("").trim_end())
            .collect::<Vec<_>>()
            .join("\n")
            .trim_end()
            .to_string(),
    )
}

/// Markdown of the texts, plus the doc comments of the library's sources (`//!`, `///`).
fn texts_with_code() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = documents()
        .into_iter()
        .filter(|(p, _)| p.extension().is_some_and(|x| x == "md"))
        .map(|(p, t)| (p.strip_prefix(root()).unwrap_or(&p).display().to_string(), t))
        .collect();
    let mut stack = vec![root().join("src")];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let doc: String = fs::read_to_string(&p)
                    .unwrap()
                    .lines()
                    .filter_map(|l| {
                        let t = l.trim_start();
                        t.strip_prefix("//!")
                            .or_else(|| t.strip_prefix("///"))
                            .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    })
                    .map(|l| format!("{l}\n"))
                    .collect();
                out.push((p.strip_prefix(root()).unwrap().display().to_string(), doc));
            }
        }
    }
    out
}

#[test]
fn every_rust_listing_is_a_compiled_file() {
    let mut bad = Vec::new();
    let mut found = 0;
    for (file, text) in texts_with_code() {
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let fence = l.trim_start();
            let is_rust = fence == "```rust" || fence.starts_with("```rust,") || fence == "```no_run" || fence == "```";
            // A bare ``` opens a block only where no block is open: count fences before this one.
            let open = lines[..i].iter().filter(|x| x.trim_start().starts_with("```")).count() % 2 == 0;
            if !(is_rust && open) || (fence == "```" && !looks_like_rust(&lines[i + 1..])) {
                continue;
            }
            found += 1;
            let marker = i.checked_sub(1).map(|j| lines[j]).unwrap_or("");
            let Some(path) = marker.trim().strip_prefix("<!-- listing: ").and_then(|m| m.split_whitespace().next())
            else {
                bad.push(format!(
                    "{file}:{}: a Rust listing without `<!-- listing: examples/….rs -->` above it",
                    i + 1
                ));
                continue;
            };
            let end = lines[i + 1..]
                .iter()
                .position(|x| x.trim_start().starts_with("```"))
                .map_or(lines.len(), |e| i + 1 + e);
            let shown = lines[i + 1..end].iter().map(|l| l.trim_end()).collect::<Vec<_>>().join("\n");
            match listing(path) {
                None => bad.push(format!("{file}:{}: {path} has no `// listing: begin` … `// listing: end`", i + 1)),
                Some(want) if want.trim_end() != shown.trim_end() => {
                    bad.push(format!("{file}:{}: the listing differs from {path}; it should read:\n{want}", i + 1))
                }
                _ => {}
            }
        }
    }
    assert!(found >= 4, "found only {found} Rust listings: is the scan broken?");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

fn looks_like_rust(after: &[&str]) -> bool {
    after.first().is_some_and(|l| l.starts_with("use ") || l.starts_with("let ") || l.starts_with("fn "))
}

/// The listed examples run (they are compiled by `cargo test` with the rest).
#[test]
fn the_listed_examples_run() {
    let dir = std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("examples");
    for name in ["all_reduce", "trainer_fit"] {
        if !dir.join(name).exists() {
            // `cargo test` builds the examples; `cargo test --test docs` alone does not.
            eprintln!("examples/{name}.rs is not built: run plain `cargo test` to run it");
            continue;
        }
        let out = Command::new(dir.join(name))
            .env("SHARDLAB_TIMEOUT_S", "60")
            .output()
            .unwrap_or_else(|e| panic!("cannot run examples/{name}.rs ({}): {e}", dir.display()));
        assert!(
            out.status.success(),
            "examples/{name}.rs failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_extraction_finds_commands() {
    let md = "Run `cargo run --release --bin collectives -- --world-size 2` or\n```sh\nSHARDLAB_TRANSPORT=tcp cargo run --bin train -- \\\n  --steps 3   # short\ncargo grade 03 --hint 2\n```";
    let c = commands(md);
    assert_eq!(
        c,
        vec![
            "cargo run --release --bin collectives -- --world-size 2",
            "cargo run --bin train -- --steps 3",
            "cargo grade 03 --hint 2"
        ]
    );
    assert!(is_placeholder("N") && is_placeholder("NN") && is_placeholder("<file>"));
    assert!(!is_placeholder("64M") && !is_placeholder("4K,1M") && !is_placeholder("2"));
}

/// The lessons the README's course table marks ready (its last column starts with "ready").
fn ready_lessons() -> BTreeSet<u32> {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    readme
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            // "| NN | lesson | … | status |": empty first and last cells around the row.
            let nn = cells.get(1)?.parse::<u32>().ok()?;
            let status = cells.get(cells.len().checked_sub(2)?)?;
            status.starts_with("ready").then_some(nn)
        })
        .collect()
}

/// Where `text` calls lesson NN "planned" (or "in progress"): "lesson NN, planned", "(lesson NN
/// planned)", "lesson NN is planned", "[NN title](…) (in progress)" — the word within a clause
/// after the lesson's number (a clause ends at ". " or "; ").
fn planned_lessons(text: &str) -> Vec<(u32, String)> {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = Vec::new();
    for (i, _) in flat.match_indices("planned").chain(flat.match_indices("in progress")) {
        let start = flat[..i].char_indices().rev().nth(60).map_or(0, |(j, _)| j);
        let before = &flat[start..i];
        // The clause the word is in: back to the last sentence or list break.
        let cut = [". ", "; "].iter().filter_map(|b| before.rfind(b).map(|j| j + b.len())).max().unwrap_or(0);
        let clause = &before[cut..];
        let number = |s: &str| s.chars().take_while(char::is_ascii_digit).collect::<String>().parse::<u32>().ok();
        let mut found =
            clause.match_indices("lesson ").filter_map(|(j, m)| number(&clause[j + m.len()..])).collect::<Vec<_>>();
        found.extend(clause.match_indices('[').filter_map(|(j, _)| number(&clause[j + 1..])));
        for nn in found {
            out.push((nn, format!("…{}planned…", &flat[start..i])));
        }
    }
    out
}

#[test]
fn no_text_calls_a_ready_lesson_planned() {
    let ready = ready_lessons();
    assert!(ready.len() >= 16, "the course table should mark lessons 00–15 ready: {ready:?}");
    let mut stale = Vec::new();
    for (path, text) in documents() {
        for (nn, at) in planned_lessons(&text) {
            if ready.contains(&nn) {
                stale.push(format!(
                    "{}: calls lesson {nn:02} planned, the course table says ready: {at}",
                    path.display()
                ));
            }
        }
    }
    assert!(stale.is_empty(), "stale text:\n{}", stale.join("\n"));
}

#[test]
fn the_planned_check_finds_what_it_should() {
    let hits = |t: &str| planned_lessons(t).into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert_eq!(hits("an elastic restart (lesson 10, planned)."), vec![10]);
    assert_eq!(hits("via `ProcessGroup::from_env` (lesson 11,\nplanned)."), vec![11]);
    assert_eq!(hits("* **[15 scaling out on paper](../15_scaling_out/README.md) (planned).**"), vec![15]);
    assert_eq!(hits("* `sim` (lesson 15, in progress) — the cluster simulator"), vec![15]);
    assert_eq!(hits("lesson 12 builds it. Deferred initialisation is planned."), Vec::<u32>::new());
    assert_eq!(hits("the bytes lesson 14 planned per rank"), vec![14], "a false alarm a reader can reword");
}

/// Each notebook code cell's source.
fn notebook_cells() -> Vec<(PathBuf, usize, String)> {
    let mut out = Vec::new();
    for e in fs::read_dir(root().join("notebooks")).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "ipynb") {
            continue;
        }
        let nb: serde_json::Value = serde_json::from_str(&fs::read_to_string(&p).unwrap()).unwrap();
        for (i, cell) in nb["cells"].as_array().into_iter().flatten().enumerate() {
            if cell["cell_type"] != "code" {
                continue;
            }
            let s = match &cell["source"] {
                serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect::<String>(),
                other => other.as_str().unwrap_or("").to_string(),
            };
            out.push((p.clone(), i, s));
        }
    }
    out
}

/// Why a cell would lose a chart, or None. evcxr keeps one image per cell (its outputs are a map
/// by MIME type), so a second `.show()` / `show_svg(…)` in a cell, or one inside a loop, replaces
/// the image before it; `plot::show_all` stacks several charts into one image.
fn loses_a_chart(src: &str) -> Option<String> {
    // Code only: string literals and comments blanked, so their braces and words do not count.
    let b = src.as_bytes();
    let mut code = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'r' && matches!(b.get(i + 1), Some(b'#') | Some(b'"')) {
            let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
            if b.get(i + 1 + hashes) != Some(&b'"') {
                code.push('r');
                i += 1;
                continue;
            }
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + 2 + hashes;
            i = src[body..].find(&close).map_or(b.len(), |j| body + j + close.len());
            code.push_str("\"\"");
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            code.push_str("\"\"");
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            // A char literal such as '{'.
            i += 3;
            code.push_str("' '");
        } else {
            let c = src[i..].chars().next().unwrap();
            code.push(c);
            i += c.len_utf8();
        }
    }
    let shows: Vec<usize> = [".show()", "show_svg(", "show_all("]
        .iter()
        .flat_map(|m| code.match_indices(m).map(|(j, _)| j).collect::<Vec<_>>())
        .collect();
    if shows.len() > 1 {
        return Some(format!("{} charts shown: evcxr keeps only the last", shows.len()));
    }
    let &at = shows.first()?;
    // Is the call inside a loop's body? Walk the braces up to it; a block opened after `for`,
    // `while`, `loop` or `for_each` (since the previous `;`, `{` or `}`) is a loop body.
    let mut open: Vec<bool> = Vec::new();
    let mut clause = String::new();
    for c in code[..at].chars() {
        match c {
            '{' => {
                let words: Vec<&str> =
                    clause.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|w| !w.is_empty()).collect();
                open.push(words.iter().any(|w| matches!(*w, "for" | "while" | "loop" | "for_each")));
                clause.clear();
            }
            '}' => {
                open.pop();
                clause.clear();
            }
            ';' => clause.clear(),
            c => clause.push(c),
        }
    }
    open.contains(&true).then(|| "a chart is shown inside a loop: evcxr keeps only the last one".to_string())
}

#[test]
fn every_notebook_chart_is_kept() {
    let mut lost = Vec::new();
    let mut cells_with_charts = 0;
    for (path, i, src) in notebook_cells() {
        if src.contains(".show()") || src.contains("show_svg(") || src.contains("show_all(") {
            cells_with_charts += 1;
        }
        if let Some(why) = loses_a_chart(&src) {
            lost.push(format!(
                "{} cell {i}: {why}; stack them with shardlab::plot::show_all",
                path.strip_prefix(root()).unwrap_or(&path).display()
            ));
        }
    }
    assert!(cells_with_charts >= 20, "the notebooks draw charts: found {cells_with_charts} cells");
    assert!(lost.is_empty(), "charts a notebook would lose:\n{}", lost.join("\n"));
}

#[test]
fn the_chart_check_finds_what_it_should() {
    assert_eq!(loses_a_chart("let c = 1;\nc.show();"), None);
    assert!(loses_a_chart("a.show();\nb.show();").is_some(), "two charts in a cell");
    assert!(loses_a_chart("for r in &rows {\n    plot::show_svg(&svg(r));\n}").is_some(), "a chart per row");
    assert!(loses_a_chart("rows.iter().for_each(|r| { svg(r).show() });").is_some());
    assert_eq!(loses_a_chart("for r in &rows { v.push(r) }\nchart(&v).show();"), None, "after the loop");
    assert_eq!(loses_a_chart("println!(\"for {} x\", 1); // a.show()\nb.show();"), None, "strings and comments");
    assert_eq!(loses_a_chart("let s = r#\"for {\"#;\nif ok { b.show(); }"), None, "raw strings");
    assert_eq!(loses_a_chart("plot::show_all(&[a.svg(), b.svg()]);"), None);
}

/// Every exercise has its hints in its lesson's `hints.md` (what `cargo grade NN --hint K` prints),
/// at least two, under `### K.`; no README prints a hint (a `<details>` block hides nothing in an
/// editor).
#[test]
fn every_exercise_has_hints_and_no_readme_prints_them() {
    let mut problems = Vec::new();
    let mut lessons = 0;
    for e in fs::read_dir(root().join("lessons")).unwrap().flatten() {
        let dir = e.path();
        let Ok(stub) = fs::read_to_string(dir.join("exercise.rs")) else { continue };
        lessons += 1;
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let readme = fs::read_to_string(dir.join("README.md")).unwrap_or_default();
        if readme.contains("<summary>Hint") {
            problems.push(format!("{name}/README.md prints hints: they belong in hints.md"));
        }
        let hints = fs::read_to_string(dir.join("hints.md")).unwrap_or_default();
        let count = stub.lines().filter(|l| l.starts_with("/// Exercise ")).count();
        for k in 1..=count {
            let head = format!("\n### {k}.");
            let n = hints.find(&head).map_or(0, |at| {
                let rest = &hints[at + head.len()..];
                rest[..rest.find("\n### ").unwrap_or(rest.len())].matches("<summary>Hint").count()
            });
            if n < 2 {
                problems.push(format!("{name}: exercise {k} has {n} hint(s) in hints.md, at least 2 wanted"));
            }
        }
    }
    assert!(lessons >= 15, "lessons with exercises: {lessons}");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A lesson reads in one sitting: what a learner needs before the exercises (the opening and the
/// concepts, everything above `## Exercises`) is at most about 350 lines; derivations, design notes
/// and measurements go below a `## Reference` heading at the end.
#[test]
fn every_lesson_reads_in_one_sitting() {
    let mut long = Vec::new();
    for e in fs::read_dir(root().join("lessons")).unwrap().flatten() {
        let Ok(text) = fs::read_to_string(e.path().join("README.md")) else { continue };
        if !e.path().join("exercise.rs").exists() {
            continue;
        }
        let name = e.file_name().to_string_lossy().to_string();
        let lines: Vec<&str> = text.lines().collect();
        let before = lines.iter().position(|l| l.starts_with("## Exercises")).unwrap_or(lines.len());
        if before > 360 {
            long.push(format!("{name}: {before} lines before `## Exercises` (at most about 350)"));
        }
        if let Some(r) = lines.iter().position(|l| *l == "## Reference") {
            if lines[r + 1..].iter().any(|l| l.starts_with("## ")) {
                long.push(format!("{name}: a `## ` section after `## Reference` (the reference comes last)"));
            }
        } else if lines.len() > 450 {
            long.push(format!(
                "{name}: {} lines and no `## Reference` section for what the exercises do not need",
                lines.len()
            ));
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
}
