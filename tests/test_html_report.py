"""The HTML run report: a real ledger from a real rollout, the page loaded in a real headless Chromium.

The browser tests read the DOM Chromium dumps after the page's own script ran (``--dump-dom``), so they see
what a researcher sees: counts, the histogram's bars, the throughput bars, the failure groups, the transcript
browser and its search applied from the URL hash. They need a ``chromium`` binary: skipped without one on a
developer's machine, a failure on CI (``CI`` set), where ``.ci/run`` installs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, ClassVar

import pytest

from interlens import ConfigurationError, Conversation, LedgerError, ScriptedParticipant, dataset_field
from interlens.report._html_report import _TIME_BUCKETS, _histogram, _Times, write_report

INJECTION = "</script><script>document.title='pwned'</script><b id=\"inj\">bold</b>"
TOPICS = ["tabs", "spaces", "bad one", "crash now", INJECTION, "bad two", "vim", "emacs"]


def _speaker(name: str) -> ScriptedParticipant:
    def reply(view: Any) -> str:
        topic = view.messages[0].content
        if "crash" in topic:
            raise RuntimeError("participant crashed\nsecond line of the traceback")
        if topic == INJECTION and name == "b":
            return "<img src=x onerror=\"document.title='pwned'\"> and </script> too"
        return f"{name} on {topic.split()[0][:8]}: " + "word " * (len(view.messages) * 2 + len(topic) % 5)

    return ScriptedParticipant(name, reply)


def _grade(conv: Any) -> dict[str, bool]:
    if conv.row["topic"].startswith("bad"):
        raise ValueError(f"cannot grade <i>{conv.row['topic']}</i>\nsecond line")
    return {"ok": True}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Eight jobs: five done, two failed in the analyzer (ValueError), one failed in a turn (RuntimeError)."""
    out_dir = tmp_path_factory.mktemp("run") / "debate"
    conv = (
        Conversation(participants=[_speaker("a"), _speaker("b")], shared_context=dataset_field("topic"))
        .turns(4)
        .analyzer(_grade)
    )
    report = conv.data([{"topic": t} for t in TOPICS]).rollout(out_dir=out_dir)
    transcripts = {jid: r.transcript for jid, r in report.results.items()}
    errors = {jid: r.error for jid, r in report.results.items()}
    return {"out_dir": out_dir, "report": report, "transcripts": transcripts, "errors": errors}


@pytest.fixture(scope="module")
def page(run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(run["out_dir"], tmp_path_factory.mktemp("html") / "report.html")


# ------------------------------------------------------------------------------------------- a tiny DOM


class _Node:
    def __init__(self, tag: str, attrs: dict[str, str | None]) -> None:
        self.tag, self.attrs, self.children = tag, attrs, []  # type: list[Any]

    def iter(self) -> Any:
        yield self
        for child in self.children:
            if isinstance(child, _Node):
                yield from child.iter()

    def find_all(self, tag: str | None = None, **attrs: str) -> list[_Node]:
        def matches(node: _Node) -> bool:
            if tag is not None and node.tag != tag:
                return False
            for key, value in attrs.items():
                key = key.rstrip("_").replace("_", "-")
                have = node.attrs.get(key)
                if key == "class":
                    if have is None or value not in have.split():
                        return False
                elif have != value:
                    return False
            return True

        return [n for n in self.iter() if matches(n)]

    def one(self, tag: str | None = None, **attrs: str) -> _Node:
        found = self.find_all(tag, **attrs)
        assert len(found) == 1, f"expected one {tag} {attrs}, found {len(found)}"
        return found[0]

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)


class _Tree(HTMLParser):
    VOID: ClassVar[set[str]] = {
        "meta",
        "input",
        "br",
        "img",
        "link",
        "hr",
        "col",
        "area",
        "base",
        "wbr",
        "source",
    }

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = _Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = _Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def _parse(html: str) -> _Node:
    tree = _Tree()
    tree.feed(html)
    tree.close()
    return tree.root


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("no chromium binary on CI: .ci/run installs Debian's chromium (apt-get install chromium)")
    pytest.skip(
        "no chromium binary found: install one (Debian: apt-get install -y chromium) to run this test"
    )


def _dom(path: Path, fragment: str, profile: Path) -> _Node:
    """The DOM after the page's script ran, as Chromium dumps it."""
    url = path.resolve().as_uri() + fragment
    done = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",  # tests run as root on CI
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=3000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "<body" in done.stdout, done.stderr[-2000:]
    return _parse(done.stdout)


def _has_class(node: _Node, name: str) -> bool:
    return name in (node.attrs.get("class") or "").split()


def _visible(dom: _Node) -> list[str | None]:
    """Ids of the jobs the transcript browser shows (the search hides the others)."""
    return [
        li.attrs["data-job-id"] for li in dom.one(id="job-list").find_all("li") if "hidden" not in li.attrs
    ]


def _bar_values(dom: _Node, section: str) -> list[float]:
    return [float(r.attrs["data-value"] or 0) for r in dom.one(id=section).find_all("rect")]


# ------------------------------------------------------------------------------------------------ browser


def _hay(run: dict[str, Any], job_id: str) -> str:
    transcript = run["transcripts"][job_id] or []
    error = run["errors"][job_id]
    parts = [job_id, "rollout", *(f"{m.author}: {m.content}" for m in transcript)]
    if error is not None:
        parts += [error.type, error.message]
    return "\n".join(parts).lower()


def test_page_in_chromium_counts_charts_failures_and_browser(run, page, tmp_path):
    dom = _dom(page, "", tmp_path / "profile")
    report = run["report"]
    assert dom.one("head").one("title").text.startswith("interlens run")  # the page's own title stands
    counts = {
        n.attrs["data-count"]: int(n.text)
        for n in dom.one(id="counts").find_all(class_="n")
        if n.attrs.get("data-count")
    }
    assert counts["total"] == 8
    assert counts["done"] == 5 == len(report.results) - len(report.failed)
    assert counts["failed"] == 3 and counts["pending"] == 0 and counts["running"] == 0

    # the histogram: one bar per token count, each as tall as the turns with that many tokens
    generated = [m.n_tokens for t in run["transcripts"].values() if t for m in t if "n_tokens" in m.metadata]
    assert counts["turns"] == len(generated) and counts["tokens"] == sum(generated)
    bars = dom.one(id="histogram").find_all("rect")
    shown: Counter[int] = Counter()
    for bar in bars:
        label = bar.one("title").text
        match = re.fullmatch(r"(\d+)(?:–(\d+))? tokens: (\d+) turns?", label)
        assert match, label
        low, high = int(match[1]), int(match[2] or match[1])
        assert int(match[3]) == float(bar.attrs["data-value"] or 0)
        expected = sum(1 for n in generated if low <= n <= high)
        assert expected == int(match[3]), label
        shown[low] += int(match[3])
    assert sum(shown.values()) == len(generated)

    # per speaker: turns, tokens and how the turns ended, most tokens first
    per_author: dict[str, list[Any]] = {}
    for t in run["transcripts"].values():
        for m in t or []:
            if "n_tokens" in m.metadata:
                per_author.setdefault(m.author, []).append(m)
    rows = [[td.text for td in tr.find_all("td")] for tr in dom.one(id="speakers").find_all("tr")[1:]]
    expected_rows = [
        [
            author,
            str(len(ms)),
            str(sum(m.n_tokens for m in ms)),
            f"{sum(m.n_tokens for m in ms) / len(ms):.1f}",
            f"stop {len(ms)}",
        ]
        for author, ms in sorted(per_author.items(), key=lambda kv: -sum(m.n_tokens for m in kv[1]))
    ]
    assert rows == expected_rows and [r[0] for r in rows] in (["a", "b"], ["b", "a"])

    # throughput: every token, turn and finished job lands in exactly one bucket
    assert sum(_bar_values(dom, "throughput-tokens")) == sum(generated)
    assert sum(_bar_values(dom, "throughput-turns")) == len(generated)
    jobs_bars = dom.one(id="throughput-jobs").find_all("rect")
    assert sum(float(b.attrs["data-value"] or 0) for b in jobs_bars if _has_class(b, "done")) == 5
    assert sum(float(b.attrs["data-value"] or 0) for b in jobs_bars if _has_class(b, "failed")) == 3

    # failures grouped by type, the first line of each message, the job ids as links
    groups = {g.attrs["data-error-type"]: g for g in dom.one(id="failures").find_all(class_="failure-group")}
    assert set(groups) == {"ValueError", "RuntimeError"}
    assert groups["ValueError"].attrs["data-count"] == "2"
    lines = {
        r.one("code").text: [a.text for a in r.find_all("a")] for r in groups["ValueError"].find_all("tr")
    }
    assert lines == {
        "cannot grade <i>bad one</i>": ["row_00002"],
        "cannot grade <i>bad two</i>": ["row_00005"],
    }
    runtime = groups["RuntimeError"].one("tr")
    assert runtime.one("code").text == "participant crashed"
    assert [a.attrs["href"] for a in runtime.find_all("a")] == ["#job=row_00003"]

    # the transcript browser lists every job; with no search, all visible and the first one open
    items = dom.one(id="job-list").find_all("li")
    assert [li.attrs["data-job-id"] for li in items] == list(report.results)
    assert not any("hidden" in li.attrs for li in items)
    detail = dom.one(id="job-detail")
    assert detail.one("h3").text == "row_00000"
    assert json.loads(detail.one(class_="analysis").one("pre").text) == run["report"].analyses()["row_00000"]
    transcript = run["transcripts"]["row_00000"]
    turns = detail.find_all(class_="turn")
    assert [t.one(class_="author").text for t in turns] == [m.author for m in transcript]
    assert [t.one(class_="content").text for t in turns] == [m.content for m in transcript]
    # the page's own script and JSON stayed intact: the injection never ran, nor became an element
    assert dom.find_all(id="inj") == [] and dom.find_all("img") == [] and dom.find_all("i") == []
    assert "pwned" not in dom.one("head").one("title").text


def test_search_from_the_url_filters_jobs_and_marks_hits(run, page, tmp_path):
    dom = _dom(page, "#q=BAD", tmp_path / "profile")
    expected = [jid for jid in run["transcripts"] if "bad" in _hay(run, jid)]
    assert expected == ["row_00002", "row_00005"]
    assert _visible(dom) == expected
    assert len(dom.one(id="job-list").find_all("li")) == 8
    assert dom.one(id="match-count").text == "2 of 8 jobs match"
    assert dom.one(id="job-search").attrs.get("value") in (None, "BAD")  # value is a property, not markup
    detail = dom.one(id="job-detail")
    assert detail.one("h3").text == "row_00002"  # the first match opens
    assert detail.find_all(class_="analysis") == []  # its analyzer raised: no value
    assert detail.one("pre", class_="error").text.startswith("ValueError: cannot grade <i>bad one</i>")
    assert {m.text.lower() for m in detail.find_all("mark")} == {"bad"}
    assert len(detail.find_all("mark")) == sum(
        m.content.lower().count("bad") for m in run["transcripts"]["row_00002"]
    )


@pytest.mark.parametrize("fragment", ["#job=row_00004", "#q=pwned"], ids=["opened", "searched"])
def test_a_transcript_with_script_and_html_is_shown_as_text(run, page, tmp_path, fragment):
    """Opened plainly and with its search hits marked (two code paths that put text into the page)."""
    dom = _dom(page, fragment, tmp_path / "profile")
    if "q=" in fragment:
        assert _visible(dom) == ["row_00004"]
    detail = dom.one(id="job-detail")
    assert detail.one("h3").text == "row_00004"
    contents = [t.one(class_="content").text for t in detail.find_all(class_="turn")]
    assert contents == [m.content for m in run["transcripts"]["row_00004"]]
    assert contents[0] == INJECTION and "</script> too" in contents[2]
    assert dom.find_all(id="inj") == [] and dom.find_all("img") == [] and dom.find_all("b") == []
    assert dom.one("head").one("title").text.startswith("interlens run")
    # one script of data, one of code: no script the transcript opened
    assert len(dom.find_all("script")) == 2


# ------------------------------------------------------------------------------------- the file, no browser


def _embedded(html: str) -> dict[str, Any]:
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S)
    assert match
    return json.loads(match[1])


def test_page_is_self_contained_and_the_json_is_escaped(run, page):
    html = page.read_text(encoding="utf-8")
    assert re.search(r"\b(src|href)=[\"']?(https?:|//)", html) is None and "<link" not in html
    assert "@import" not in html and "url(" not in html
    assert INJECTION not in html and "<img" not in html
    data = _embedded(html)
    by_id = {job["id"]: job for job in data["jobs"]}
    assert by_id["row_00004"]["turns"][0]["content"] == INJECTION
    assert [t["author"] for t in by_id["row_00002"]["turns"]] == ["moderator", "a", "b", "a", "b"]
    assert by_id["row_00003"]["turns"] == [] and by_id["row_00003"]["error_type"] == "RuntimeError"
    assert data["total_jobs"] == data["embedded"] == 8
    assert "cap-note" not in html


def test_large_runs_embed_the_first_jobs_and_say_so(run, tmp_path):
    out = write_report(run["out_dir"], tmp_path / "capped.html", max_jobs=3, max_chars=5)
    html = out.read_text(encoding="utf-8")
    data = _embedded(html)
    assert [job["id"] for job in data["jobs"]] == ["row_00000", "row_00001", "row_00002"]
    assert data["total_jobs"] == 8
    assert "embeds the transcripts of the first 3 of 8 jobs" in html
    first = data["jobs"][0]["turns"][1]
    full = run["transcripts"]["row_00000"][1].content
    assert first["content"] == full[:5] and first["cut"] == len(full)
    # the statistics still cover every job
    assert 'data-count="failed">3<' in html and 'data-count="total">8<' in html


def test_missing_or_non_ledger_directories_are_clear_errors(run, tmp_path):
    with pytest.raises(LedgerError, match=r"not a directory.*out_dir a rollout wrote") as missing:
        write_report(tmp_path / "nope", tmp_path / "r.html")
    assert str(tmp_path / "nope") in str(missing.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LedgerError, match=r"holds no ledger.sqlite.*not a run directory"):
        write_report(tmp_path / "empty", tmp_path / "r.html")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "ledger.sqlite").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(LedgerError, match="ledger"):
        write_report(tmp_path / "junk", tmp_path / "r.html")
    with pytest.raises(ConfigurationError, match=r"folder of output .* does not exist"):
        write_report(run["out_dir"], tmp_path / "no" / "r.html")
    with pytest.raises(ConfigurationError, match="is a directory"):
        write_report(run["out_dir"], tmp_path)
    with pytest.raises(ConfigurationError, match="max_jobs"):
        write_report(run["out_dir"], tmp_path / "r.html", max_jobs=-1)
    with pytest.raises(TypeError, match="out_dir must be"):
        write_report(3, tmp_path / "r.html")  # type: ignore[arg-type]
    assert not (tmp_path / "r.html").exists()


def test_the_ledger_file_itself_is_accepted(run, tmp_path):
    out = write_report(run["out_dir"] / "ledger.sqlite", tmp_path / "r.html")
    assert _embedded(out.read_text(encoding="utf-8"))["total_jobs"] == 8


def test_time_buckets_keep_every_count_when_the_resolution_coarsens():
    times = _Times()
    start = 1_700_000_000.0
    for i in range(50_000):  # 50k distinct milliseconds over 500 s: more keys than are kept
        times.add(start + i * 0.01, 0)
        times.add(start + i * 0.01, 1, 3)
    times.add(None, 0)
    assert times.resolution > 0.001
    origin, width, rows = times.buckets()
    assert len(rows) <= _TIME_BUCKETS and width == 10
    assert origin <= start and origin + len(rows) * width >= start + 500
    assert sum(r[0] for r in rows) == 50_000 and sum(r[1] for r in rows) == 150_000


async def test_a_live_run_reports_pending_and_running_jobs_with_their_turns(tmp_path):
    """Written while the run's writer holds the ledger open: read-only, mid-run states and partial turns."""
    from interlens.store import JobRecord, Ledger

    out_dir = tmp_path / "live"
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"left": "fp-left", "right": "fp-right"}, versions={"interlens": "test"})
        await ledger.add_jobs(
            JobRecord(f"{side}_{i}", side, seed=i, row_index=i)
            for side in ("left", "right")
            for i in range(2)
        )
        await ledger.start_job("left_0", device="cpu")
        await ledger.record_turn(
            "left_0", 0, {"author": "a", "content": "half way", "metadata": {"n_tokens": 2}}
        )
        await ledger.start_job("right_1", device="cpu")
        html = write_report(out_dir, tmp_path / "live.html").read_text(encoding="utf-8")
    for state, n in (("total", 4), ("pending", 2), ("running", 2), ("done", 0), ("failed", 0), ("turns", 1)):
        assert f'data-count="{state}">{n}<' in html
    lineups = _parse(html).one(id="lineups")
    rows = [[td.text for td in tr.find_all("td")] for tr in lineups.find_all("tr")[1:]]
    assert rows == [["left", "1", "1", "0", "0"], ["right", "1", "1", "0", "0"]]
    jobs = {job["id"]: job for job in _embedded(html)["jobs"]}
    assert [t["content"] for t in jobs["left_0"]["turns"]] == ["half way"]
    assert jobs["right_1"]["state"] == "running" and jobs["right_1"]["turns"] == []
    assert "No job failed." in html


def test_run_report_to_html_writes_the_same_page(run, tmp_path):
    out = run["report"].to_html(tmp_path / "from_report.html", max_jobs=2)
    data = _embedded(out.read_text(encoding="utf-8"))
    assert data["total_jobs"] == 8 and [job["id"] for job in data["jobs"]] == ["row_00000", "row_00001"]
    in_memory = Conversation(participants=[_speaker("a")], shared_context="tabs").turns(1).rollout(n=1)
    with pytest.raises(ConfigurationError, match=r"kept no ledger.*out_dir="):
        in_memory.to_html(tmp_path / "nope.html")


def test_embedding_stops_at_the_size_cap_and_says_so(run, tmp_path, monkeypatch):
    import interlens.report._html_report as html_report

    sizes = [sum(len(m.content) for m in t or []) for t in run["transcripts"].values()]
    monkeypatch.setattr(html_report, "_EMBED_CHARS", sizes[0] + sizes[1])
    html = write_report(run["out_dir"], tmp_path / "r.html").read_text(encoding="utf-8")
    assert [job["id"] for job in _embedded(html)["jobs"]] == ["row_00000", "row_00001"]
    assert "first 2 of 8 jobs" in html and "stops at" in html


def test_histogram_of_a_wide_range_uses_wider_bins_and_keeps_every_turn():
    counts = Counter({n: 1 + n % 3 for n in range(3, 1001, 7)})
    chart = _histogram(counts)
    titles = [bar["title"] for bar in chart["bars"]]
    assert 1 < len(chart["bars"]) <= 40
    spans = [re.fullmatch(r"(\d+)–(\d+) tokens: (\d+) turns?", t) for t in titles]
    assert all(spans), titles
    widths = set()
    for match in spans:
        assert match is not None
        low, high = int(match[1]), int(match[2])
        widths.add(high - low + 1)
        assert low % (high - low + 1) == 0  # bins start on a multiple of their width
        assert int(match[3]) == sum(c for n, c in counts.items() if low <= n <= high)
    assert widths == {25}  # the narrowest nice width that fits 3..997 in 40 bins
    assert sum(int(m[3]) for m in spans if m) == sum(counts.values())


async def test_failure_groups_stay_bounded_however_many_jobs_fail(tmp_path, monkeypatch):
    """60 jobs fail the same way and 3 more in ways of their own: 50 ids shown and a count of the rest;
    past the distinct first lines kept per type, new lines are counted together."""
    import interlens.report._html_report as html_report
    from interlens.store import JobRecord, Ledger

    monkeypatch.setattr(html_report, "_FAILURE_KEPT", 2)
    messages = ["out of memory\ndetail"] * 60 + ["odd one", "odd two", "odd three"]
    out_dir = tmp_path / "failing"
    async with await Ledger.open(out_dir) as ledger:
        await ledger.begin_run({"l": "fp"}, versions={})
        await ledger.add_jobs(JobRecord(f"j{i:03d}", "l", seed=i) for i in range(len(messages)))
        for i, message in enumerate(messages):
            await ledger.start_job(f"j{i:03d}", device="cpu")
            await ledger.fail_job(f"j{i:03d}", error_type="GenerationError", message=message, traceback="tb")
    html = write_report(out_dir, tmp_path / "r.html").read_text(encoding="utf-8")
    group = _parse(html).one(class_="failure-group")
    assert group.attrs["data-count"] == "63"
    rows = {
        r.one("code").text: (
            r.one(class_="num").text,
            [a.text for a in r.find_all("a")],
            r.find_all(class_="note"),
        )
        for r in group.find_all("tr")
    }
    assert list(rows) == ["out of memory", "(other messages)", "odd one"]  # most frequent first
    count, ids, note = rows["out of memory"]
    assert count == "60" and ids == [f"j{i:03d}" for i in range(50)] and note[0].text == "and 10 more"
    assert rows["odd one"][:2] == ("1", ["j060"])
    assert rows["(other messages)"][:2] == ("2", ["j061", "j062"])
