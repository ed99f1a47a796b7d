"""Fine-tuning from an exported checkpoint: pre-train, export the weights, train on from them.

    python examples/fine_tune.py [section.key=value ...]

The spiral MLP of own_mlp.py is pre-trained on noisy spirals, its newest checkpoint is
exported (what `python -m paisoar_jax.export RUN_DIR --output DIR` does), and a second run
starts from those weights (`checkpoint.init_from`) with a fresh optimizer, a lower learning
rate and cleaner data.
"""

import pathlib
import shutil
import sys

from own_mlp import MLP, loss, spirals

import paisoar_jax

if __name__ == "__main__":
    common = ["train.global_batch=64", "train.log_every=50", "train.eval_every=100"]
    pre_train = paisoar_jax.fit(
        None,
        ["run.name=spirals_pretrain", "train.steps=200", *common, *sys.argv[1:]],
        model=lambda rngs: MLP(rngs),
        loss=loss,
        data=spirals(4096, seed=0),
        eval_data=spirals(512, seed=1),
    )
    export_dir = pathlib.Path(pre_train["run_dir"]) / "export"
    shutil.rmtree(export_dir, ignore_errors=True)
    paisoar_jax.export_run(pre_train["run_dir"], export_dir)
    tuned = paisoar_jax.fit(
        None,
        [
            "run.name=spirals_finetune",
            "train.steps=100",
            "optim.lr=3e-4",
            "optim.warmup_steps=0",
            f"checkpoint.init_from={export_dir}",
            *common,
            *sys.argv[1:],
        ],
        model=lambda rngs: MLP(rngs),
        loss=loss,
        data=spirals(4096, seed=2),
        eval_data=spirals(512, seed=3),
    )
    print(
        f"pre-trained eval_loss {pre_train['eval_loss']:.4f}, fine-tuned {tuned['eval_loss']:.4f}"
    )
