"""Offline inference with DeepInfer: the same shape as vLLM's ``LLM.generate`` and ``LLM.chat``.

    python examples/offline_inference.py                      # embedded tiny model, offline, seconds on a CPU
    python examples/offline_inference.py --model /path/to/DeepSeek-V4.1-checkpoint
    DEEPINFER_HF_MODEL_DIR=/path/to/checkpoint python examples/offline_inference.py

On several devices (docs/parallel.md): one engine rank per process under torchrun, or let LLM start its ranks:

    torchrun --nproc-per-node 4 examples/offline_inference.py --data-parallel-size 4 --expert-parallel-size 4
    python examples/offline_inference.py --data-parallel-size 2 --expert-parallel-size 2

With no model configured, DeepInfer uses the tiny DeepSeek-V4.1 checkpoint that ships in the package
(a toy trained on simple stories; it exercises the full V4.1 architecture but knows little English).
DeepInfer's one-line notices (which model, which backend) go to stderr; DEEPINFER_LOGGING_LEVEL=WARNING hides them.
"""

from __future__ import annotations

import argparse

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a big red ball. One day,",
    "One day, a small dog found a shiny key",
    "The sun was warm. Mia and her mom went to the park.",
]
#: Conversations for LLM.chat, rendered in the model's chat format (DeepSeek-V4.1's for V4.1 checkpoints).
CHATS = [
    [{"role": "user", "content": "Tell me a story about a cat named Mia."}],
    [{"role": "system", "content": "You tell short stories for children."},
     {"role": "user", "content": "Write a short story about Max the dog."}],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or Hugging Face repo id")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--data-parallel-size", type=int, default=1, help="ranks owning whole requests")
    parser.add_argument("--expert-parallel-size", type=int, default=1, help="ranks splitting the MoE experts")
    args = parser.parse_args()

    llm = LLM(model=args.model, seed=0, data_parallel_size=args.data_parallel_size,
              expert_parallel_size=args.expert_parallel_size)
    # No per-request seed: each request draws its own from LLM(seed=0), so reruns reproduce.
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, min_tokens=4)
    outputs = llm.generate(PROMPTS, params)
    replies = llm.chat(CHATS, params)  # thinking off (chat_template_kwargs={"thinking": True} turns it on)
    llm.shutdown()  # the ranks LLM started, if any
    if llm.parallel is not None and llm.parallel.context.plan.rank != 0:
        return  # under torchrun every rank has every output; rank 0 prints them
    for output in outputs:
        completion = output.outputs[0]
        print(f"\nPrompt: {output.prompt!r}\nOutput: {completion.text!r}  [{completion.finish_reason}, "
              f"{len(completion.token_ids)} tokens]")
    for chat, reply in zip(CHATS, replies, strict=True):
        print(f"\nChat: {chat[-1]['content']!r}\nReply: {reply.outputs[0].text!r}")


if __name__ == "__main__":
    main()
