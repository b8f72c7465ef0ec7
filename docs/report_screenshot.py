"""Regenerate docs/report.png: a small debate between tiny local models, its HTML report, a Chromium shot.

    python docs/report_screenshot.py            # writes runs/report-demo, docs/report.html, docs/report.png

The models have random weights (built locally, nothing downloaded), so the turns are noise; the analyzer
fails a few jobs on purpose so the failure groups have something to show.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from interlens import AutoModelParticipant, Conversation, dataset_field
from interlens.testing import tiny_model

TOPICS = [
    "tabs or spaces",
    "vim or emacs",
    "monorepo or polyrepo",
    "static or dynamic typing",
    "REST or GraphQL",
    "SQL or NoSQL",
    "microservices or monolith",
    "dark mode or light mode",
]


def grade(conv: Conversation) -> dict[str, int]:
    longest = max(len(m.content) for m in conv.transcript)
    if conv.row["topic"].startswith(("REST", "SQL")):
        raise ValueError(f"no verdict on {conv.row['topic']!r}: neither side cited evidence")
    if longest > 80 and conv.seed % 3 == 0:
        raise KeyError("verdict")
    return {"longest": longest}


def main() -> None:
    root = Path(__file__).resolve().parent
    path = tiny_model("qwen2")
    speakers = [
        AutoModelParticipant.from_pretrained(path, name=name, temperature=1.0, max_new_tokens=40, stop=stop)
        for name, stop in (("pro", ["e"]), ("con", ["a"]))
    ]
    conv = (
        Conversation(participants=speakers, shared_context=("Debate: ", dataset_field("topic"), "."))
        .turns(6)
        .analyzer(grade)
    )
    rows = [{"topic": t} for t in TOPICS for _ in range(4)]
    out_dir = Path("runs/report-demo")
    report = conv.data(rows).rollout(out_dir=out_dir, resume=False)
    page = report.to_html(root / "report.html")
    chromium = shutil.which("chromium") or sys.exit("needs chromium (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                "--window-size=1400,1750",
                "--virtual-time-budget=3000",
                f"--screenshot={root / 'report.png'}",
                page.resolve().as_uri() + "#q=vim",
            ],
            check=True,
        )
    (root / "report.html").unlink()
    print(f"wrote {root / 'report.png'} from {out_dir}")


if __name__ == "__main__":
    main()
