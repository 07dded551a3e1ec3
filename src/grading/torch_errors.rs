//! libtorch's errors in a learner's code, made readable: a tch call that libtorch refuses panics
//! with `Torch("…")` and a C++ backtrace, raised inside tch. The grader shows libtorch's one-line
//! reason and the line of exercise.rs it came from instead.

/// The line of the learner's exercise.rs that the last libtorch error came from, read off the
/// panic's backtrace (a libtorch panic is raised inside tch, not where the learner's code is).
pub(super) static LAST_TORCH_AT: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// A panic from libtorch (`Torch("…")` with a C++ backtrace) as one readable line: libtorch's own
/// message, where in exercise.rs it came from when known, and what usually causes it. Any other
/// message is returned as it is.
pub fn tidy_libtorch_error(msg: &str, at: Option<&str>) -> String {
    let Some(i) = msg.find("Torch(\"") else { return msg.to_string() };
    let inner = &msg[i + 7..];
    let end = ["\\nException raised from", "\nException raised from", "\")"]
        .iter()
        .filter_map(|m| inner.find(m))
        .min()
        .unwrap_or(inner.len());
    let what = inner[..end].replace("\\n", " ").replace('\n', " ");
    let before = msg[..i].trim_end_matches("called `Result::unwrap()` on an `Err` value: ").trim_end();
    let before = if before.is_empty() { String::new() } else { format!("{before} ") };
    let at = at.map(|a| format!(" at {a}")).unwrap_or_default();
    format!(
        "{before}libtorch refused an operation in your code{at}: {what}. Usually a shape: print the `.size()` of the \
         tensors that line uses and compare them with the shapes in the exercise's comment."
    )
}

/// The first `lessons/…/exercise.rs:LINE` frame of the current backtrace.
pub(super) fn exercise_frame() -> Option<String> {
    let bt = std::backtrace::Backtrace::force_capture().to_string();
    let at = bt.find("exercise.rs:")?;
    let start = bt[..at].rfind("lessons/")?;
    let line: String = bt[at + "exercise.rs:".len()..].chars().take_while(char::is_ascii_digit).collect();
    Some(format!("{}exercise.rs:{line}", &bt[start..at]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_libtorch_panic_becomes_one_line_with_its_place() {
        let raw =
            "tp=2: called `Result::unwrap()` on an `Err` value: Torch(\"The size of tensor a (6) must match the size \
                   of tensor b (12) at non-singleton dimension 2\\nException raised from infer_size_impl at \
                   aten/src/ATen/ExpandUtils.cpp:31 (most recent call first):\\nframe #0: c10::Error::Error\")";
        let t = tidy_libtorch_error(raw, Some("lessons/12_tensor_parallel/exercise.rs:97"));
        assert_eq!(
            t,
            "tp=2: libtorch refused an operation in your code at lessons/12_tensor_parallel/exercise.rs:97: The size of \
             tensor a (6) must match the size of tensor b (12) at non-singleton dimension 2. Usually a shape: print the \
             `.size()` of the tensors that line uses and compare them with the shapes in the exercise's comment."
        );
        assert_eq!(tidy_libtorch_error("plain failure", None), "plain failure");
    }
}
