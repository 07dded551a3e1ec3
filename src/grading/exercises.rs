//! Reading an exercise file: its `/// Exercise K` sections, their `pub fn` stubs, whether each is
//! still the untouched `todo!()`, and a fingerprint that tells whether a grading is still current.

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

/// The exercise number of a grader test: `ex3_ring_all_reduce…` → 3.
pub fn exercise_number(test: &str) -> Option<usize> {
    let rest = test.rsplit("::").next()?.strip_prefix("ex")?;
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// The exercise whose section holds line `line` (1-based) of an exercise file.
pub(super) fn exercise_at_line(src: &str, line: u32) -> Option<usize> {
    let mut current = None;
    for (i, l) in src.lines().enumerate() {
        current = exercise_header(l).or(current);
        if i + 1 == line as usize {
            return current;
        }
    }
    None
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
pub(crate) fn strip_comments_and_strings(src: &str) -> String {
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
    fn test_names_map_to_exercises() {
        assert_eq!(exercise_number("exercise::ex3_ring_all_reduce"), Some(3));
        assert_eq!(exercise_number("ex12_x"), Some(12));
        assert_eq!(exercise_number("layout"), None);
    }
}
