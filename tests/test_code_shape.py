#!/usr/bin/env python3
"""The code's shape, checked mechanically (ctest code_shape):

  - no function longer than 80 lines outside tests/ and the parsers listed in LONG_OK, each with why;
  - no file in compactor/ longer than 800 lines.

A function is found by its definition at column 0 (a line that opens a parameter list and ends in
'{', ',' or ')') and ends at the next '}' at column 0: the project's formatting (clang-format,
functions' braces at column 0) makes that exact enough. Usage: test_code_shape.py REPO_ROOT."""
import pathlib
import re
import sys

MAX_FUNCTION_LINES = 80
MAX_COMPACTOR_FILE_LINES = 800

# (file, function name): why it may stay long
LONG_OK = {
    ("formats/tokenizer.c", "load_model"): "a parser: one field of tokenizer.json after another",
    ("formats/tokenizer.c", "kf_tokenizer_open"): "a parser: reads and checks the file, then builds the tables",
    ("formats/safetensors.c", "parse_header"): "a parser: one JSON entry's fields, each checked",
    ("formats/hfconfig.c", "parse_root"): "a parser: one config.json field after another",
    ("formats/tokenizer_bpe.c", "kf_bpe_encode_word"): "a parser: the merge loop over one pre-token",
    ("kernels/cuda/attention.cu", "kf_attention_kernel"): "a GPU kernel, left whole until it can be run "
                                                          "on a device after a split",
}

DEF = re.compile(r"^[A-Za-z_][^;]*\b([A-Za-z_]\w*)\s*\(")


def functions(path):
    lines = path.read_text(errors="replace").split("\n")
    start = name = None
    for i, line in enumerate(lines):
        if start is None:
            m = DEF.match(line)
            if m and not line.startswith(("typedef", "struct", "enum", "#")) and \
                    line.rstrip().endswith(("{", ",", ")")) and "=" not in line.split("(")[0]:
                start, name = i, m.group(1)
        elif line.startswith("}"):
            yield name, start + 1, i - start + 1
            start = None


def main(root):
    root = pathlib.Path(root)
    bad = []
    for path in sorted(list(root.glob("*/**/*.c")) + list(root.glob("*/**/*.cu"))):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("build", "tests/", ".")) or "/build" in rel:
            continue
        for name, line, n in functions(path):
            if n > MAX_FUNCTION_LINES and (rel, name) not in LONG_OK:
                bad.append(f"{rel}:{line}: {name} is {n} lines (at most {MAX_FUNCTION_LINES})")
        if rel.startswith("compactor/"):
            n = len(path.read_text(errors="replace").split("\n")) - 1
            if n > MAX_COMPACTOR_FILE_LINES:
                bad.append(f"{rel}: {n} lines (a compactor file holds at most {MAX_COMPACTOR_FILE_LINES})")
    for (rel, name) in LONG_OK:
        if not (root / rel).exists():
            bad.append(f"LONG_OK names {rel}, which does not exist")
    print("\n".join(bad) if bad else "code_shape: every function within %d lines, every compactor file within %d"
          % (MAX_FUNCTION_LINES, MAX_COMPACTOR_FILE_LINES))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
