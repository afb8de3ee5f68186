"""hotweights demo: a tiny model learns to say one token; its new weights are hot-installed into a running vLLM.

Runs on CPU with no hub access (the model is built locally). ``make demo`` sets everything up and runs it.
"""

from __future__ import annotations

import tempfile
import time

from _quiet import quiet

quiet()  # before torch and vLLM are imported; also runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)

import torch  # noqa: E402

import hotweights  # noqa: E402
from hotweights.testing import (  # noqa: E402
    PROMPTS,
    build_tiny_model,
    greedy_hf,
    greedy_vllm,
    save_tiny_model,
    start_engine,
    stop_engine,
)

TARGET = 42  # the token the "policy" is trained to emit


def train_steps(model: torch.nn.Module, steps: int) -> float:
    """A few real optimizer steps: raise the probability of TARGET after every prompt."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = torch.tensor(0.0)
        for prompt in PROMPTS:
            logits = model(torch.tensor([prompt])).logits[0, -1]
            loss = loss + torch.nn.functional.cross_entropy(logits[None], torch.tensor([TARGET]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item() / len(PROMPTS)


def main() -> None:
    t0 = time.perf_counter()
    policy = build_tiny_model("qwen2", seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        llm = start_engine(save_tiny_model(policy, tmp), use_tqdm_on_load=False)
        print(f"\nengine up in {time.perf_counter() - t0:.1f} s")
        before = greedy_vllm(llm, max_tokens=4)
        print(f"before:  first tokens {[o[0] for o in before]}  (target {TARGET})")

        for step in (1, 2):
            loss = train_steps(policy, steps=2)
            report = hotweights.install(llm, policy.state_dict(), weight_version=step)
            after = greedy_vllm(llm, max_tokens=4)
            hits = sum(o[0] == TARGET for o in after)
            print(f"step {step}: loss {loss:.3f}; {report}")
            print(f"         first tokens {[o[0] for o in after]}  ({hits}/{len(after)} prompts now emit {TARGET})")
            agree = after == greedy_hf(policy, max_tokens=4)
            print(
                f"         engine weight version {llm.llm_engine.get_weight_version()}; equals HF transformers: {agree}"
            )

        try:
            hotweights.install(llm, policy.state_dict(), weight_version=1)
        except hotweights.StaleWeightVersionError as exc:
            print(f"\nrefused, as it should be: {exc}")
        bad = {k: v for k, v in policy.state_dict().items() if "layers.1." not in k}
        try:
            hotweights.install(llm, bad, weight_version=3)
        except hotweights.WeightManifestValidationError as exc:
            print(
                f"refused, nothing written ({len(exc.mismatches)} mismatches), still serving v"
                f"{hotweights.adapter_for(llm).active_weight_version}"
            )
        stop_engine(llm)
    print(f"\ndemo done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
