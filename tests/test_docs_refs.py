#!/usr/bin/python3
"""Cross-references that a reader of the repository can follow, checked mechanically.

  1. No tracker references: no "issue N", "issue #N", "#N" (a number after '#') and no "the
     issue's ..." in any source, test, script or document: the repository explains itself (vLLM's
     layouts are named by vLLM version, not by its pull requests).
  2. No references to material outside the repository: a design document that is not here
     (DESIGN.md), research notes, sibling folders.
  3. Every relative path in docs/*.md and README.md exists: markdown links and images, and
     path-like words in backticks (`compactor/am.h`, `tools/bench-*.sh`).
  4. Every source file a comment names (`am.c`, `compactor/refq.h`, `kvfold/pool.py`) exists.
  5. Every kvfold symbol (kf_*, kvf_*, kvb_*, in either case) named in a comment or in backticks
     in a document exists in the code.

Prints one line per finding, FILE:LINE: what, and exits 1 when there is any; 0 otherwise.
Usage: tests/test_docs_refs.py [REPO_ROOT]   (default: this file's repository)
"""
import io
import os
import re
import subprocess
import sys
import tokenize

HERE = os.path.abspath(__file__)
ROOT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(HERE))

# Files of other projects that comments name: vLLM's scheduler (vllm/v1/core/sched/scheduler.py),
# whose behaviour the connector follows. System headers a source includes count as well.
EXTERNAL = {"scheduler.py"}
SKIP_DIRS = {".git", "node_modules", "__pycache__", ".pytest_cache", ".cache"}
C_LIKE = (".c", ".h", ".cu", ".cuh", ".js")
HASH_COMMENTS = (".sh", ".sbatch", ".cmake", ".txt", ".yaml", ".yml", ".toml", ".gitignore")
SOURCE_EXT = r"(?:c|h|cu|cuh|py|md|sh)"

TRACKER = [
    (re.compile(r"\bissues?\s*#?\s*\d+", re.I), "names a tracker issue"),
    (re.compile(r"\b(?:the|this|that)\s+issue(?:'s)?\b|\(issue\b(?!s?\s*#?\s*\d)", re.I), "refers to a tracker issue"),
]
HASH_NUMBER = re.compile(r"(?<![\w&/#])#(\d+)\b")
OUTSIDE_PATH = "names a path outside the repository"
CI_SCRIPT = ".ci/run"
OUTSIDE = [
    (re.compile(r"DESIGN\.md"), "names DESIGN.md, which is not in the repository (docs/design.md is)"),
    (re.compile(r"\.\./shared|/work/"), OUTSIDE_PATH),
    (re.compile(r"\bresearch[ /]notes?\b|\bresearch/[\w-]+\.md|\bshared notes\b", re.I),
     "names research notes that are not in the repository"),
    (re.compile(r"\bseed 0\d\d\b"), "names a design seed that is not in the repository"),
]
COMMENT_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-][\w.-]*\.%s)(?![\w/-])" % SOURCE_EXT)
SYMBOL = re.compile(r"(?<![\w.])((?:kf|kvf|kvb|KF|KVF|KVB)_\w*)(\*?)")
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
BACKTICK = re.compile(r"`([^`\n]+)`")


def repo_files():
    """Relative paths of the repository's files: git's view (tracked and new, not ignored) when it
    has one, else a walk that skips build trees."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True).stdout
        files = [f for f in out.decode().split("\0") if f and os.path.isfile(os.path.join(ROOT, f))]
        if files:
            return sorted(files)
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for d, dirs, names in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith("build") and not x.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
    return sorted(files)


def read_text(rel):
    """The file's text, or None for binary files and the fixtures' data."""
    if rel.startswith("tests/data/") and not rel.endswith(".md"):
        return None
    with open(os.path.join(ROOT, rel), "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def c_split(text):
    """(comments, code) of C-like text: comments as [(line, text)], code with comments blanked."""
    comments, code, i, n, line = [], [], 0, len(text), 1
    while i < n:
        c = text[i]
        if text.startswith("/*", i) or text.startswith("//", i):
            end = text.find("*/", i + 2) + 2 if text[i + 1] == "*" else text.find("\n", i)
            end = n if end < 2 or end == -1 else end
            comments.append((line, text[i:end]))
            line += text.count("\n", i, end)
            code.append("\n" * text.count("\n", i, end))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            code.append(text[i:j + 1])
            line += text.count("\n", i, j + 1)
            i = j + 1
        else:
            code.append(c)
            line += c == "\n"
            i += 1
    return comments, "".join(code)


def py_comments(text):
    """Comments and docstrings of Python text as [(line, text)]."""
    out, prev = [], tokenize.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
            elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                out.append((tok.start[0], tok.string))
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                prev = tok.type
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def hash_comments(text):
    """'#' comments (at a line's start or after a blank) as [(line, text)]."""
    out = []
    for k, s in enumerate(text.split("\n"), 1):
        m = re.search(r"(?:^|\s)(#.*)$", s)
        if m:
            out.append((k, m.group(1)))
    return out


def comments_of(rel, text):
    if rel.endswith(C_LIKE):
        return c_split(text)[0]
    if rel.endswith(".py"):
        return py_comments(text)
    if rel.endswith(HASH_COMMENTS) or "." not in os.path.basename(rel) or rel.startswith(".ci/"):
        return hash_comments(text)
    return []


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


class Checker:
    def __init__(self):
        self.files = repo_files()
        self.by_base = {}
        for f in self.files:
            self.by_base.setdefault(os.path.basename(f), []).append(f)
        self.texts = {f: read_text(f) for f in self.files}
        self.findings = []
        self.symbols = self.code_symbols()
        self.system_headers = {m.group(1) for t in self.texts.values() if t
                               for m in re.finditer(r"#\s*include\s*<([\w./]+)>", t)}

    def add(self, rel, line, what):
        self.findings.append(f"{rel}:{line}: {what}")

    def code_symbols(self):
        """Every kf_/kvf_/kvb_ identifier the code defines or uses (comments left out)."""
        names = set()
        for rel, text in self.texts.items():
            if text is None or rel == os.path.relpath(HERE, ROOT):
                continue
            if rel.endswith(C_LIKE):
                names.update(m.group(1) for m in SYMBOL.finditer(c_split(text)[1]))
            elif rel.endswith((".py", ".txt", ".cmake", ".sh")):
                names.update(m.group(1) for m in SYMBOL.finditer(text))
        return names

    def exists(self, path, rel_dir):
        """path (relative, maybe a glob) names a file or folder of the repository."""
        path = path.rstrip("/")
        for base in (ROOT, os.path.join(ROOT, rel_dir)):
            full = os.path.normpath(os.path.join(base, path))
            if os.path.exists(full) or (any(ch in path for ch in "*?[") and self.glob(full)):
                return True
        return False

    def glob(self, pattern):
        import glob
        return bool(glob.glob(pattern))

    def source_exists(self, path, rel_dir):
        if path in EXTERNAL or path in self.system_headers or self.exists(path, rel_dir):
            return True
        if "/" not in path:
            return path in self.by_base
        return any(f.endswith("/" + path) for f in self.files)

    def check_text(self, rel, text):
        for rx, what in TRACKER + OUTSIDE:
            if rel == CI_SCRIPT and what == OUTSIDE_PATH:
                continue  # CI's machine lays the vLLM snapshot beside the clone: CI's own contract
            for m in rx.finditer(text):
                self.add(rel, line_of(text, m.start()), f"'{m.group(0)}' {what}")
        for m in HASH_NUMBER.finditer(text):
            self.add(rel, line_of(text, m.start()), f"'{m.group(0)}' looks like a tracker reference")

    def check_symbol(self, rel, line, name, star):
        bare = name.rstrip("_")
        if len(bare) <= 3 or bare in self.symbols:
            return
        if (star or name.endswith("_")) and any(s.startswith(name) for s in self.symbols):
            return
        self.add(rel, line, f"names {name}{star}, which the code does not have")

    def check_comments(self, rel, text):
        rel_dir = os.path.dirname(rel)
        for line, c in comments_of(rel, text):
            for m in COMMENT_PATH.finditer(c):
                word = c[max(0, c.rfind(" ", 0, m.start()) + 1):m.end()]
                path = m.group(1)
                if "://" in word or "$" in word or path.startswith("vllm/"):  # URLs, made at run time, vLLM's
                    continue
                if not self.source_exists(path, rel_dir):
                    self.add(rel, line + c.count("\n", 0, m.start()), f"names {path}, which does not exist")
            for m in SYMBOL.finditer(c):
                self.check_symbol(rel, line + c.count("\n", 0, m.start()), m.group(1), m.group(2))

    def check_doc(self, rel, text):
        rel_dir = os.path.dirname(rel)
        for m in MD_LINK.finditer(text):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not self.exists(target, rel_dir):
                self.add(rel, line_of(text, m.start()), f"links to {target}, which does not exist")
        for m in BACKTICK.finditer(text):
            word, line = m.group(1), line_of(text, m.start())
            for s in SYMBOL.finditer(word):
                self.check_symbol(rel, line, s.group(1), s.group(2))
            if " " in word or any(ch in word for ch in "<>$={}|") or word.startswith(("/", "~", "-", ".")):
                continue
            top = word.split("/")[0]
            in_repo = "/" in word and os.path.isdir(os.path.join(ROOT, top))
            if in_repo or re.fullmatch(r"[\w.-]+\.%s" % SOURCE_EXT, word):
                if not self.source_exists(word, rel_dir):
                    self.add(rel, line, f"names `{word}`, which does not exist")

    def run(self):
        me = os.path.relpath(HERE, ROOT)
        for rel, text in self.texts.items():
            if text is None or rel == me:
                continue
            self.check_text(rel, text)
            self.check_comments(rel, text)
            if rel == "README.md" or (rel.startswith("docs/") and rel.endswith(".md")):
                self.check_doc(rel, text)
        return self.findings


def main():
    if not os.path.isdir(os.path.join(ROOT, "compactor")):
        print(f"test_docs_refs: {ROOT} is not the kvfold repository", file=sys.stderr)
        return 1
    findings = Checker().run()
    for f in findings:
        print(f)
    print(f"test_docs_refs: {len(findings)} dangling or outside references", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
