#!/usr/bin/env python3
"""Play the learner who finishes the course: `cargo test` must go green, then red on one mistake.

1. Every `pub fn` body of every lessons/NN_slug/exercise.rs is replaced by the reference
   solution's body of the same function (what a learner who solved it would have typed; the
   exercise file keeps its own comments, imports and layout). The README's test command,
   `cargo test`, must pass and its progress table must say "N of N exercises done", N being the
   number of `/// Exercise K` sections in the shipped stubs.
2. One plausible wrong answer from .ci/wrong_answers.py is put into that lesson's solved file.
   `cargo test` must fail, and its output must name the lesson and the exercise (the progress
   table's "Next: lesson NN exercise K ... fails.") and carry the grader's reason.

The exercise files are restored afterwards, whatever happens. Run from the repository root,
after `bash .ci/setup`: `python3 .ci/learner_play.py [--wrong NN K]` (default: lesson 04, ex 3).
"""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wrong_answers import WRONG, failure_sections  # noqa: E402

DEFAULT_WRONG = ("04", 3)


def lessons():
    """[(nn, slug)] of the lessons that have an exercise file."""
    out = []
    for d in sorted(os.listdir("lessons")):
        if re.fullmatch(r"\d\d_\w+", d) and os.path.isfile(f"lessons/{d}/exercise.rs"):
            out.append((d[:2], d))
    return out


def code_mask(src):
    """A copy of `src` in which comments and the insides of string and char literals are blanked
    (same length), so that braces and `fn` inside them are not read as code."""
    out = list(src)
    i, n = 0, len(src)

    def blank(a, b):
        for j in range(a, min(b, n)):
            if out[j] != "\n":
                out[j] = " "

    while i < n:
        c, nxt = src[i], src[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif c == "/" and nxt == "*":
            depth, j = 0, i
            while j < n:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                    if depth == 0:
                        break
                else:
                    j += 1
            blank(i, j)
            i = j
        elif re.match(r'[bc]?r#*"', src[i:i + 260]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            # A raw string (also b"…"'s and c"…"'s raw forms): no escapes, ends at `"` + its hashes.
            m = re.match(r'[bc]?r(#*)"', src[i:])
            start = i + m.end()
            end = src.find('"' + m.group(1), start)
            if end < 0:
                sys.exit("learner_play: an unterminated raw string")
            blank(start, end)
            i = end + 1 + len(m.group(1))
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
        elif c == "'" and i + 2 < n and src[i + 2] == "'" and src[i + 1] != "\\":
            blank(i + 1, i + 2)
            i += 3
        elif c == "'" and nxt == "\\":
            # An escaped char literal: '\n', '\'', '\u{7b}'.
            j = src.find("'", i + 3)
            if j < 0:
                sys.exit("learner_play: an unterminated char literal")
            blank(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def pub_fn_bodies(src):
    """{name: (start, end)} of each `pub fn`'s body in `src`, braces included."""
    code = code_mask(src)
    out = {}
    for m in re.finditer(r"\bpub(\([^)]*\))?\s+fn\s+(\w+)", code):
        name, depth, i = m.group(2), 0, m.end()
        # The body opens at the first `{` outside parentheses and brackets.
        while i < len(code):
            c = code[i]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif c == "{" and depth == 0:
                break
            i += 1
        level, j = 0, i
        while j < len(code):
            if code[j] == "{":
                level += 1
            elif code[j] == "}":
                level -= 1
                if level == 0:
                    break
            j += 1
        if name in out:
            sys.exit(f"learner_play: two `pub fn {name}`s in one file")
        out[name] = (i, j + 1)
    return out


def solved(stub, solution, where):
    """The stub with each pub fn body replaced by the solution's body of the same function."""
    mine, theirs = pub_fn_bodies(stub), pub_fn_bodies(solution)
    if not mine or set(mine) != set(theirs):
        sys.exit(f"learner_play: {where}: the stub's pub fns {sorted(mine)} are not the solution's {sorted(theirs)}")
    out, last = [], 0
    for name, (a, b) in sorted(mine.items(), key=lambda kv: kv[1][0]):
        s, e = theirs[name]
        out += [stub[last:a], solution[s:e]]
        last = b
    out.append(stub[last:])
    return "".join(out)


def cargo_test(label):
    """Runs the README's test command; returns (exit code, stdout, stdout + stderr). On a time-out
    or an interruption the whole process group goes (cargo, the test binaries, their ranks)."""
    t0 = time.time()
    env = dict(os.environ, CARGO_TERM_COLOR="never")
    env.pop("RUST_TEST_NOCAPTURE", None)  # the failure sections below are libtest's captured output
    p = subprocess.Popen(["cargo", "test"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=2700)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    print(f"learner_play: {label}: `cargo test` exited {p.returncode} after {time.time() - t0:.0f} s", flush=True)
    return p.returncode, out, out + err


def table(stdout):
    """The progress table: the end of the output of the last test binary that ran."""
    i = stdout.rfind("Your progress")
    return stdout[i:] if i >= 0 else ""


def read(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def write(path, text):
    """Whole or not at all: a temporary file renamed over `path`."""
    tmp = path + ".learner_play"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def graded_exercises():
    """{(lesson, K)} of the exercises the graders test (`fn exK_…` in tests/lessonNN.rs)."""
    out = set()
    for nn, _ in lessons():
        out |= {(nn, int(k)) for k in re.findall(r"\bfn ex(\d+)_", read(f"tests/lesson{nn}.rs"))}
    return out


def main():
    args = sys.argv[1:]
    wrong = DEFAULT_WRONG
    if args[:1] == ["--wrong"] and len(args) == 3:
        wrong = (args[1], int(args[2]))
    elif args:
        sys.exit(__doc__)
    # A CI time-out or a closed terminal still puts the stubs back (the `finally` below).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit("learner_play: interrupted"))
    originals = {}
    solved_text = {}
    sections = set()
    for nn, slug in lessons():
        path = f"lessons/{slug}/exercise.rs"
        originals[path] = read(path)
        sections |= {(nn, int(k)) for k in re.findall(r"^\s*/// Exercise (\d+)", originals[path], flags=re.M)}
        solved_text[nn] = (path, solved(originals[path], read(f"solutions/{slug}.rs"), path))
    # The count the table must reach, from two sources that must agree: the stubs' sections and
    # the graders' tests.
    if sections != graded_exercises():
        sys.exit(f"learner_play: exercise sections {sorted(sections)} and graded exercises "
                 f"{sorted(graded_exercises())} differ")
    total = len(sections)
    try:
        # 1. Every exercise solved: green, and the table counts them all.
        for path, text in solved_text.values():
            write(path, text)
        rc, out, log = cargo_test("every exercise solved")
        want = f"{total} of {total} exercises done."
        if rc != 0 or want not in table(out) or "Every exercise passes." not in table(out):
            print(log[-20000:])
            sys.exit(f"learner_play: with every exercise solved `cargo test` must pass and end with {want!r}")
        print(table(out))

        # 2. One wrong answer: red, naming the lesson, the exercise and the grader's reason.
        nn, k = wrong
        entry = next((w for w in WRONG if w[0] == nn and w[1] == k), None)
        if entry is None:
            sys.exit(f"learner_play: .ci/wrong_answers.py has no wrong answer for lesson {nn} exercise {k}")
        _, _, mistake, edits, expect = entry
        path, text = solved_text[nn]
        for find, repl in edits:
            if text.count(find) != 1:
                sys.exit(f"learner_play: {find!r} is not in the solved {path} exactly once")
            text = text.replace(find, repl)
        write(path, text)
        rc, out, log = cargo_test(f"lesson {nn} exercise {k} wrong ({mistake})")
        # cargo stops at the first test binary that fails: it must be this lesson's grader, its
        # exercise K test must fail with the grader's reason, and the table must name it next.
        mine = {t: sec for t, sec in failure_sections(out).items() if t.startswith(f"exercise::ex{k}_")}
        named = re.search(rf"Next: lesson {nn} exercise {k} \(`[^)]*`\) fails\.", table(out))
        if (rc == 0 or f"--test lesson{nn}`" not in log or not named
                or not any(expect in sec for sec in mine.values())):
            print(log[-20000:])
            sys.exit(f"learner_play: with a wrong answer in lesson {nn} exercise {k}, `cargo test` must fail in "
                     f"tests/lesson{nn}.rs, its exercise::ex{k}_ test saying {expect!r}, and the table must "
                     f"name lesson {nn} exercise {k} as failing")
        print(table(out))
        print(f"learner_play: every exercise solved passes ({want}); a wrong answer in lesson {nn} "
              f"exercise {k} fails, and says so: {', '.join(sorted(mine))}")
    finally:
        # A second signal must not stop the restoring half-way.
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        for path, text in originals.items():
            write(path, text)


if __name__ == "__main__":
    main()
