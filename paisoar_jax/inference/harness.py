"""lm-evaluation-harness on our models, where they live: the `paisoar_jax` harness model.

`HarnessModel` is an `lm_eval.api.model.TemplateLM` over a `Generator` (inference/
generator.py): a run, a checkpoint step or an export of a zoo decoder, placed on the
devices as its config says. It answers the harness's three requests:

    loglikelihood           the context and continuation tokenized as lm-eval's own `hf`
                            model does (the whole, then the context: TemplateLM's split),
                            scored in one forward pass per batch (Generator.score), the
                            longest requests together
    loglikelihood_rolling   a document's tokens in lm-eval's rolling windows of the model's
                            positions, each window's new tokens summed
    generate_until          greedy or sampled continuation (Generator.generate), cut at
                            the first stop string, as `hf` cuts it

Chats render through the tokenizer's chat template (`--apply_chat_template`). Importing
this module registers the model with lm-eval as `paisoar_jax`, so
`lm_eval.simple_evaluate(model="paisoar_jax", model_args="path=RUN")` and
`python -m paisoar_jax.evaluate run --model paisoar_jax --model_args path=RUN --tasks ...`
(lm-eval's own command line, the model registered) work; `python -m paisoar_jax.evaluate
RUN --tasks ...` is the short form (tools/evaluate.py).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from paisoar_jax.engine.evaluation import HarnessTasks
from paisoar_jax.errors import UserError
from paisoar_jax.inference.generator import Generator
from paisoar_jax.inference.text import Text
from paisoar_jax.runtime.user_files import read_json

NAME = "paisoar_jax"  # the harness's name for this model: --model paisoar_jax
RESULTS_FILE = "harness.jsonl"  # a run's evaluations, one JSON line each
_LIVE: dict[int, tuple[Any, Generator]] = {}  # a training run's generator (evaluate_state)


@register_model(NAME)
class HarnessModel(TemplateLM):
    """A run, a checkpoint step or an export, answering lm-evaluation-harness's requests.

    Args:
        path: a run directory (its newest checkpoint), a checkpoint step or an export.
        batch_size: the most requests scored or generated together ("auto": 64).
        max_length: the longest sequence scored (default: the model's positions).
        max_gen_toks: generate_until's default of new tokens (a task's own wins).
        generator: a Generator already placed (the training loop's); else one of `path`.
        **unused: the harness's other settings (device, max_batch_size): the mesh decides.
    """

    def __init__(
        self,
        path: str = "",
        batch_size: int | str = 64,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        generator: Generator | None = None,
        **unused: Any,
    ):
        super().__init__()
        if generator is None and not path:
            raise UserError("the paisoar_jax harness model needs model_args path=RUN")
        self.generator = generator or Generator(path)
        self.text = Text(self.generator.tokenizer_file, self.generator.config.model.vocab_size)
        self.path = path or "the run"
        self.batch_size = 64 if batch_size in ("auto", None) else int(str(batch_size))
        positions = self.generator.config.model.positions
        self.max_length = min(int(max_length), positions) if max_length else positions
        self.max_gen_toks = int(max_gen_toks)
        self.end_ids = tuple(self.generator.end_ids)
        tokenizer_file = self.generator.tokenizer_file
        self.bos_id = _declared_token_id(tokenizer_file, self.text, "bos_token")
        self.eos_id = _declared_token_id(tokenizer_file, self.text, "eos_token")

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end-of-sequence id (as `hf`'s), else the model's first."""
        return self.end_ids[0] if self.eos_id is None else self.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: the BOS id when the tokenizer has one, else the EOS."""
        return self.bos_id if self.bos_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's file: lm-eval's cache key for chat-templated requests."""
        return str(self.generator.tokenizer_file or "bytes")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **unused: Any
    ) -> list[int]:
        """Token ids as `hf`'s tokenizer.encode gives them (its markers unless said)."""
        if self.text.model is None:
            return list(string.encode("utf-8"))
        if add_special_tokens is None:
            return self.text.encode(string)  # markers once, none before a rendered BOS
        return self.text.model.encode(string, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat as the tokenizer's template renders it."""
        return self.text.chat_text(chat_history, add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str:
        """The template's source name (the harness records it), "" without one."""
        return self.tokenizer_name if chat_template else ""

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **unused: Any):
        """(log-probability of the continuation, whether each token was the likeliest)."""
        sequences = [
            (context + continuation)[-(self.max_length + 1) :]
            for _, context, continuation in requests
        ]
        scored = self.generator.score(sequences, self.batch_size)
        answers = []
        for (key, _, continuation), (log_probs, greedy) in zip(requests, scored, strict=True):
            count = len(continuation)
            answer = (float(log_probs[-count:].sum()), bool(greedy[-count:].all()))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-probability, over windows of the model's positions."""
        windows, owners = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_probability, _) in zip(
            owners, self._loglikelihood_tokens(windows), strict=True
        ):
            totals[owner] += log_probability
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, cut before the first of its stop strings.

        Requests with the same settings (new tokens, sampling) generate together.
        """
        end_text = self.text.decode([self.eot_token_id])
        groups: dict[tuple, list[int]] = {}
        prompts, stops = [], []
        for index, request in enumerate(requests):
            context, settings = request.args
            settings = normalize_gen_kwargs(dict(settings), self.max_gen_toks)
            stops.append(handle_stop_sequences(settings.pop("until", None), eos=end_text))
            new = settings.pop("max_gen_toks")
            temperature = float(settings.get("temperature") or 0.0)
            greedy = not settings.get("do_sample", False) or temperature == 0
            top_p = float(settings.get("top_p") or 1.0)
            prompts.append(self.tok_encode(context)[-max(self.max_length - new, 1) :])
            groups.setdefault((new, greedy, temperature or 1.0, top_p), []).append(index)
        answers = [""] * len(requests)
        for (new, greedy, temperature, top_p), members in groups.items():
            made = self.generator.generate(
                [prompts[index] for index in members],
                new,
                greedy=greedy,
                temperature=temperature,
                top_p=top_p,
                stop_at=self.end_ids,
                batch_size=self.batch_size,
            )
            for index, tokens in zip(members, made, strict=True):
                text = self.text.decode([token for token in tokens if token not in self.end_ids])
                for stop in stops[index]:
                    text = text.split(stop)[0] if stop else text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
                answers[index] = text
        return answers


def _declared_token_id(tokenizer_file: pathlib.Path | None, text: Text, name: str) -> int | None:
    """The id of a special token tokenizer_config.json declares (bos_token), or None."""
    if tokenizer_file is None or text.model is None:
        return None
    config_path = tokenizer_file.parent / "tokenizer_config.json"
    token = read_json(config_path).get(name) if config_path.is_file() else None
    token = token.get("content") if isinstance(token, dict) else token
    return text.model.token_to_id(token) if isinstance(token, str) else None


def evaluate(
    source: str | pathlib.Path,
    tasks: Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 64,
    include_path: str | None = None,
    apply_chat_template: bool = False,
    model: HarnessModel | None = None,
) -> dict[str, Any]:
    """lm-eval's results of `tasks` on a run, a checkpoint step or an export.

    `model`: a HarnessModel already placed (the training loop's); else one of `source`.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = model or HarnessModel(str(source), batch_size=batch_size)
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        raise UserError(
            f"lm-eval has no task {unknown[0]!r} (`python -m paisoar_jax.evaluate ls tasks` "
            f"lists them; an include path adds your own YAMLs)"
        )
    return lm_eval.simple_evaluate(
        model=model,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        apply_chat_template=apply_chat_template,
        log_samples=False,
    )


def results_record(weights: str, tasks: Sequence[str], results: dict[str, Any]) -> dict:
    """The line harness.jsonl gets: each task's metrics (numbers only), and the settings."""
    scores = {
        task: {
            metric: value
            for metric, value in metrics.items()
            if isinstance(value, int | float) and metric != "alias"
        }
        for task, metrics in results["results"].items()
    }
    settings = {key: results["config"].get(key) for key in ("limit", "num_fewshot", "batch_size")}
    return {"weights": weights, "tasks": list(tasks), "results": scores, "config": settings}


def evaluate_state(run: Any, state: Any, harness: HarnessTasks, step: int) -> dict[str, float]:
    """The harness's tasks on a training run's weights as they are (train.harness_every).

    Returns {"<task>/<metric>": value} (lm-eval's ",none" filter dropped); the whole
    results go to the run's harness.jsonl as a line with the step.
    """
    held = _LIVE.get(id(run))
    if held is None or held[0] is not run:  # one per run: its compiles are kept
        held = _LIVE[id(run)] = (run, Generator.of_run(run, state))
    generator = held[1]
    generator.params, generator.model_state = state.params, state.model_state or {}
    model = HarnessModel(generator=generator, batch_size=harness.batch_size)
    results = evaluate(
        run.run_dir,
        harness.tasks,
        limit=harness.limit or None,
        include_path=harness.include_path or None,
        model=model,
    )
    record = results_record(str(run.run_dir), harness.tasks, results) | {"step": step}
    if jax.process_index() == 0:
        with open(pathlib.Path(run.run_dir) / RESULTS_FILE, "a") as file:
            file.write(json.dumps(record) + "\n")
    return {
        f"{task}/{metric.removesuffix(',none')}": float(value)
        for task, metrics in record["results"].items()
        for metric, value in metrics.items()
        if not metric.endswith("_stderr,none")
    }
