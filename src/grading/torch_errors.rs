//! libtorch's errors in a learner's code, made readable: a tch call that libtorch refuses panics
//! with `Torch("…")` and a C++ backtrace, raised inside tch. The grader shows libtorch's one-line
//! reason, the line of exercise.rs it came from and what usually causes it instead.

/// The line of the learner's exercise.rs that the last libtorch error came from, read off the
/// panic's backtrace (a libtorch panic is raised inside tch, not where the learner's code is).
/// Rank threads panic away from the test thread: the test thread's message takes it from here,
/// after checking that the line is in the exercise the test grades.
pub(super) static LAST_TORCH_AT: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// A panic from libtorch (`Torch("…")` with a C++ backtrace) as one readable line: libtorch's own
/// message, where in exercise.rs it came from when known (`at`), and what usually causes it; the
/// text around the `Torch(…)` block is kept. Any other message is returned as it is.
pub fn tidy_libtorch_error(msg: &str, at: Option<&str>) -> String {
    let Some(i) = msg.find("Torch(\"") else { return msg.to_string() };
    let inner = &msg[i + 7..];
    // The block ends at the first `")` whose quote is not escaped.
    let close = inner.match_indices("\")").map(|(j, _)| j).find(|&j| !inner[..j].ends_with('\\'));
    let body = &inner[..close.unwrap_or(inner.len())];
    let after = close.map_or("", |j| &inner[j + 2..]);
    let end = ["\\nException raised from", "\nException raised from"]
        .iter()
        .filter_map(|m| body.find(m))
        .min()
        .unwrap_or(body.len());
    let what = body[..end].replace("\\n", " ").replace('\n', " ").replace("\\\"", "\"");
    let what = what.trim().trim_end_matches('.');
    let before = msg[..i].trim_end_matches("called `Result::unwrap()` on an `Err` value: ").trim_end();
    let before = if before.is_empty() { String::new() } else { format!("{before} ") };
    let place = at.map_or(String::new(), |a| format!(" in your code at {a}"));
    let cause = if what.contains("undefined Tensor") || what.contains("undefined tensor") {
        "A tensor is undefined: often a gradient autograd never computed, or a `Tensor::new()` used as data"
    } else if ["boolean mask", "scalar type", "dtype", "Expected object of"].iter().any(|k| what.contains(k)) {
        "Usually a kind (dtype): print the `.kind()` of the tensors that line uses"
    } else if what.contains("view size is not compatible") {
        "A view of memory that is not contiguous: `.reshape` (or `.contiguous()` first) instead of `.view`"
    } else {
        "Usually a shape: print the `.size()` of the tensors that line uses and compare them with the shapes in \
         the exercise's comment"
    };
    format!("{before}libtorch refused an operation{place}: {what}. {cause}.{after}")
}

/// The first `lessons/…/exercise.rs:LINE` frame of the current backtrace.
pub(super) fn exercise_frame() -> Option<String> {
    let bt = std::backtrace::Backtrace::force_capture().to_string();
    let at = bt.find("exercise.rs:")?;
    let line_start = bt[..at].rfind('\n').map_or(0, |j| j + 1);
    let start = line_start + bt[line_start..at].rfind("lessons/")?;
    let line: String = bt[at + "exercise.rs:".len()..].chars().take_while(char::is_ascii_digit).collect();
    Some(format!("{}exercise.rs:{line}", &bt[start..at]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_libtorch_panic_becomes_one_line_with_its_place() {
        let raw = "tp=2: called `Result::unwrap()` on an `Err` value: Torch(\"The size of tensor a (6) must match the size \
                   of tensor b (12) at non-singleton dimension 2\\nException raised from infer_size_impl at \
                   aten/src/ATen/ExpandUtils.cpp:31 (most recent call first):\\nframe #0: c10::Error::Error\") (rank 1)";
        let t = tidy_libtorch_error(raw, Some("lessons/12_tensor_parallel/exercise.rs:97"));
        assert_eq!(
            t,
            "tp=2: libtorch refused an operation in your code at lessons/12_tensor_parallel/exercise.rs:97: The size of \
             tensor a (6) must match the size of tensor b (12) at non-singleton dimension 2. Usually a shape: print the \
             `.size()` of the tensors that line uses and compare them with the shapes in the exercise's comment. (rank 1)"
        );
        let dtype = tidy_libtorch_error(
            "Torch(\"masked_fill_ only supports boolean masks, but got mask with dtype float\")",
            None,
        );
        assert!(dtype.starts_with("libtorch refused an operation: masked_fill_"), "{dtype}");
        assert!(dtype.contains("Usually a kind (dtype)"), "{dtype}");
        let quoted = tidy_libtorch_error("Torch(\"bad \\\"x\\\") here\") after", None);
        assert!(quoted.contains("bad \"x\") here.") && quoted.ends_with(" after"), "{quoted}");
        assert_eq!(tidy_libtorch_error("plain failure", None), "plain failure");
    }
}
