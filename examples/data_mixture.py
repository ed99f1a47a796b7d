"""Two sources mixed, their weights changed by a stage and again on resume, the run cut twice.

    python examples/data_mixture.py [section.key=value ...]

Needs the datasets extra (pip install -e ".[datasets]"). The steps are the command lines a
user runs, printed as they go:

    a datasets dataset   sums ("3 + 4 = 7") saved with save_to_disk, the second source beside
                         the embedded Python source: data.source-like `hf:DIR`, tokenized
                         once into a cache by the first run
    train to step 40     data.mixture=[[embedded,0.9,python],[hf:DIR,0.1,sums]] with
                         data.mixture_stages=[[41,0.5,0.5]]; train.steps=40 stops it half way,
                         as a preemption would
    train to step 80     the same command with train.steps=80: it resumes at step 40 and the
                         stage begins at step 41, as in a run never stopped
    train to step 100    resumed with other weights, [[...,0.2],[...,0.8]]: every source goes
                         on from its place (nothing repeated, nothing skipped), said in a line

Then it prints each source's examples read and eval loss at every eval (metrics.jsonl's
`examples/<name>` and `eval_loss/<name>`), and each stretch's share of the sums. The learning
rate is constant after its warmup (optim.schedule=constant): a cosine's decay is sized by
train.steps, which these cuts raise, while the input is the same however a run is cut.
"""

import json
import pathlib
import random
import subprocess
import sys


def save_sums(directory: pathlib.Path) -> None:
    """Rows of sums of two numbers below 50, twenty to a row, as a `datasets` Dataset."""
    import datasets

    generator = random.Random(0)
    lines = [
        f"{a} + {b} = {a + b}\n"
        for a, b in ((generator.randrange(50), generator.randrange(50)) for _ in range(20_000))
    ]
    rows = [{"text": "".join(lines[start : start + 20])} for start in range(0, len(lines), 20)]
    datasets.Dataset.from_list(rows).save_to_disk(str(directory))


def train(*overrides: str) -> None:
    """Runs `python -m paisoar_jax.train overrides...` as a user would, printing the command."""
    print("$ python -m paisoar_jax.train " + " ".join(overrides), flush=True)
    subprocess.run([sys.executable, "-m", "paisoar_jax.train", *overrides], check=True)


def main(arguments: list[str]) -> None:
    """Save the sums, train in three cuts, print the per-source counts and losses."""
    work = pathlib.Path("mixture_example")
    work.mkdir(exist_ok=True)
    if not (work / "sums").is_dir():
        save_sums(work / "sums")
    common = [f"run.dir={work / 'run'}", f"data.cache_dir={work / 'cache'}"]
    common += ["train.eval_every=20", "train.eval_batches=4", "checkpoint.every=20"]
    common += ["optim.schedule=constant", *arguments]
    mixture = f"data.mixture=[[embedded,0.9,python],[hf:{work / 'sums'},0.1,sums]]"
    staged = [mixture, "data.mixture_stages=[[41,0.5,0.5]]"]
    train(*staged, "train.steps=40", *common)
    train(*staged, "train.steps=80", *common)
    changed = f"data.mixture=[[embedded,0.2,python],[hf:{work / 'sums'},0.8,sums]]"
    train(changed, "train.steps=100", *common)
    records = [
        json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    print("step  python read  sums read  eval_loss/python  eval_loss/sums")
    for record in records:
        if "eval_loss" in record:
            read = f"{record['examples/python']:11d}  {record['examples/sums']:9d}"
            losses = f"{record['eval_loss/python']:16.3f}  {record['eval_loss/sums']:14.3f}"
            print(f"{record['step']:4d}  {read}  {losses}")
    at = {record["step"]: record for record in records}
    for first, last in ((1, 40), (41, 80), (81, 100)):
        before = at.get(first - 1, {"examples/python": 0, "examples/sums": 0})
        python, sums = (
            at[last][f"examples/{n}"] - before[f"examples/{n}"] for n in ("python", "sums")
        )
        print(f"steps {first}-{last}: sums are {sums / (python + sums):.1%} of the rows read")


if __name__ == "__main__":
    main(sys.argv[1:])
