"""The figure of docs/contamination.md: `gptkit contamination` over a corpus of MB megabytes (JSON lines of
Shakespeare's text, each record a 2 kB slice with its words shuffled a little so no two records are
alike), a local task of ITEMS items of 16 made-up words, PLANTED of them planted in known records. Prepares
the corpus (byte tokenizer), then runs the scan under /usr/bin/time -v; prints the scan's time, its peak
RSS, the planted items found and any other item flagged.

    python .ci/contamination_figure.py [MB] [--keep DIR]       (default 200 MB, in a temporary folder)
"""

import json
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from gptkit.data.sources import shakespeare_text

SYLLABLES = ["zor", "blax", "quen", "vit", "mork", "tash", "plim", "drov", "gux", "yeb", "snar", "kwo"]
ITEMS, PLANTED = 2_000, 20
TASK = """task: planted_big
dataset_path: json
dataset_kwargs:
  data_files:
    test: items.jsonl
output_type: generate_until
test_split: test
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""


def main() -> int:
    mb = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 200
    keep = sys.argv[sys.argv.index("--keep") + 1] if "--keep" in sys.argv else None
    d = Path(keep or tempfile.mkdtemp(prefix="contam-"))
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    items = []
    for _ in range(ITEMS):
        words = ["".join(rng.sample(SYLLABLES, 3)) for _ in range(16)]
        items.append({"prompt": " ".join(words[:14]), "answer": " " + " ".join(words[14:])})
    (d / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    (d / "task.yaml").write_text(TASK)
    text = shakespeare_text()
    n_records = mb * 1_000_000 // 2_000
    planted = dict(zip(sorted(rng.sample(range(n_records), PLANTED)), rng.sample(range(ITEMS), PLANTED)))
    corpus = d / "corpus.jsonl"
    if not corpus.is_file():
        with open(corpus, "w") as f:
            for i in range(n_records):
                a = rng.randrange(len(text) - 2_000)
                words = re.split(r"(\s+)", text[a : a + 2_000])
                for _ in range(20):
                    j, k = rng.randrange(0, len(words), 2), rng.randrange(0, len(words), 2)
                    words[j], words[k] = words[k], words[j]
                record = "".join(words)
                if i in planted:
                    it = items[planted[i]]
                    cut = len(record) // 2
                    record = record[:cut] + " " + it["prompt"] + it["answer"] + " " + record[cut:]
                f.write(json.dumps({"text": record}) + "\n")
    # every record trains (the validation split is a file of its own)
    (d / "val.jsonl").write_text(json.dumps({"text": text[:3_000]}) + "\n")
    print(f"corpus {corpus.stat().st_size / 1e6:.0f} MB, {n_records:,} records", flush=True)
    prep = subprocess.run(
        [
            "gptkit",
            "prepare",
            "data=files",
            f"data.paths=[{corpus}]",
            f"data.val_paths=[{d / 'val.jsonl'}]",
            "tokenizer=byte",
            f"cache_dir={d / 'cache'}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
    )
    if prep.returncode:
        print(prep.stderr)
        return 1
    folder = next((d / "cache").glob("files-*"))
    report = d / "report.json"
    scan = subprocess.run(
        [
            "/usr/bin/time",
            "-v",
            "gptkit",
            "contamination",
            "data=prepared",
            f"data.dir={folder}",
            f"tasks={d / 'task.yaml'}",
            f"out={report}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
    )
    print(scan.stdout)
    if scan.returncode:
        print(scan.stderr)
        return 1
    for line in scan.stderr.splitlines():
        if any(k in line for k in ("Elapsed (wall", "Maximum resident", "User time", "documents (")):
            print(line.strip())
    rep = json.loads(report.read_text())
    flagged = set(rep["tasks"]["planted_big"]["flagged"])
    want = set(planted.values())
    print(
        f"planted {len(want)}, found {len(flagged & want)}, flagged but not planted {len(flagged - want)}; "
        f"scan {rep['seconds']:.1f} s over {rep['tokens_scanned']:,} tokens"
    )
    return 0 if flagged == want else 1


if __name__ == "__main__":
    sys.exit(main())
