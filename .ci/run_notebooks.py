"""Execute every notebook in notebooks/ headlessly through the real evcxr kernel.

A compile error, an error output, a panic or a crashed kernel in any cell fails the run, and the
real message is printed. Notebooks run one at a time (they share evcxr's build folder).

Usage (after `bash .ci/setup-notebooks`):
    .venv/bin/python .ci/run_notebooks.py [--save DIR | --write] [NOTEBOOK ...]
--save DIR writes the executed notebooks (with outputs) to DIR for a look.
--write    refreshes the committed notebooks: each one that runs cleanly is written back over its
           original with its outputs (so a learner sees the tables and plots before the first
           kernel build), without execution timestamps; an output that names a path on this
           machine fails the run instead.
CI runs it without either: the committed outputs are not compared, every notebook is re-executed.
"""
import glob
import os
import sys
import time

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["JUPYTER_PATH"] = os.path.join(ROOT, ".jupyter")
BAD_STDERR = ("panicked", "Child process terminated", "error[E", "Segmentation fault")


SHOWS = (".show()", "show_svg(", "show_all(")


def problems(nb):
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        images = sum("image/svg+xml" in o.get("data", {}) for o in cell.get("outputs", []))
        if any(s in cell.source for s in SHOWS) and images == 0:
            out.append(f"cell {i} draws a chart but its outputs hold no image")
        for o in cell.get("outputs", []):
            if o.output_type == "error":
                tb = "\n".join(o.get("traceback", []))
                out.append(f"cell {i}: {o.get('ename')}: {o.get('evalue')}\n{tb}")
            elif o.output_type == "stream" and o.get("name") == "stderr" and any(b in o.text for b in BAD_STDERR):
                out.append(f"cell {i} (stderr):\n{o.text}")
            elif o.output_type in ("execute_result", "display_data"):
                text = o.get("data", {}).get("text/plain", "")
                if text.startswith("Err("):
                    out.append(f"cell {i} returned an error: {text}")
    return out


def scrub(nb):
    """Outputs as committed: no execution timestamps, no kernel-session metadata."""
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
        for o in cell.get("outputs", []):
            o.get("metadata", {}).pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb


def machine_paths(nb):
    text = nbformat.writes(nb)
    return [p for p in (ROOT, os.path.expanduser("~"), "/tmp/") if p and p != "/" and p in text]


def main(args):
    save = None
    write = False
    if args[:1] == ["--save"]:
        save, args = args[1], args[2:]
        os.makedirs(save, exist_ok=True)
    elif args[:1] == ["--write"]:
        write, args = True, args[1:]
    paths = args or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    if not paths:
        print("notebooks: none found")
        return 1
    failed = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        t = time.time()
        client = NotebookClient(
            nb,
            kernel_name="shardlab-rust",
            timeout=1800,
            allow_errors=True,
            resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
        )
        try:
            client.execute()
            found = problems(nb)
        except Exception as e:  # kernel died, timeout, ...
            found = [f"kernel failure: {type(e).__name__}: {e}"]
        name = os.path.relpath(path, ROOT)
        if save:
            nbformat.write(nb, os.path.join(save, os.path.basename(path)))
        if write and not found:
            leaks = machine_paths(scrub(nb))
            if leaks:
                found = [f"an output names a path on this machine ({', '.join(leaks)}): not written"]
            else:
                nbformat.write(nb, path)
        if found:
            failed += 1
            print(f"FAILED {name} ({time.time() - t:.0f} s)")
            for p in found:
                print("  " + p.replace("\n", "\n  "))
        else:
            cells = sum(1 for c in nb.cells if c.cell_type == "code")
            print(f"ok     {name}: {cells} code cells ({time.time() - t:.0f} s)")
    print(f"notebooks: {len(paths) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
