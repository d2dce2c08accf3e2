"""A chat page for any OpenAI-compatible endpoint, ours (scripts/serve_openai_api.py) by default.

    streamlit run scripts/web_demo.py                                       # http://localhost:8501
    streamlit run scripts/web_demo.py -- --api_base http://127.0.0.1:8998/v1 --temperature 0

Replies stream in as the server generates them. The conversation stays on the page; the sidebar
says how many earlier turns go with each question, and holds temperature, top_p, max tokens and a
thinking switch whose reasoning is shown apart from the answer. A server that is down or answers
an error gets one line on the page, and the conversation stays as it was.
"""
import argparse
import sys

import streamlit as st

DEFAULT_API_BASE = "http://127.0.0.1:8998/v1"
# The sidebar's controls: the (low, high) of each, where a flag's start value must fall.
RANGES = {"history_turns": (0, 20), "temperature": (0.0, 2.0), "top_p": (0.05, 1.0), "max_tokens": (1, 32768)}


class FlagError(Exception):
    """A flag the page cannot take, in one line: shown on the page, where argparse would print its
    usage to the terminal and stop the script."""


class OnePageLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise FlagError(f"{message} (streamlit run scripts/web_demo.py -- --help lists the flags)")


def parse_args(argv):
    p = OnePageLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--api_base", default=DEFAULT_API_BASE, help=f"the endpoint (default {DEFAULT_API_BASE})")
    p.add_argument("--api_key", default="none", help="its key, where it asks for one")
    p.add_argument("--model", default=None, help="model name (default: the first the endpoint lists)")
    p.add_argument("--temperature", type=float, default=0.85, help="the slider's start (0: greedy)")
    p.add_argument("--top_p", type=float, default=0.85, help="the slider's start")
    p.add_argument("--max_tokens", type=int, default=512, help="the field's start")
    p.add_argument("--history_turns", type=int, default=4, help="earlier turns sent with a question, at start")
    # parse_known: under Streamlit's test runner sys.argv is the runner's own.
    return p.parse_known_args(argv)[0]


def out_of_range(args) -> str | None:
    """The first flag whose value the sidebar's control cannot show, in one line (None: none)."""
    for name, (low, high) in RANGES.items():
        value = getattr(args, name)
        if not low <= value <= high:  # NaN included
            return f"--{name} {value} is outside the sidebar's range [{low}, {high}]: pass a value inside it"
    return None


def turns_to_send(history: list[dict], turns: int) -> list[dict]:
    """The last `turns` question-answer pairs of `history` (answers only, not their reasoning; not
    the questions that got no answer), then its last message, the new question."""
    earlier = [m for m in history[:-1] if not m.get("unanswered")]
    question = history[-1]
    kept = earlier[len(earlier) - 2 * turns:] if turns > 0 else []
    return [{"role": m["role"], "content": m["content"]} for m in kept + [question]]


def one_line(error: Exception, api_base: str) -> str:
    import openai

    if isinstance(error, openai.APIConnectionError):
        return f"Cannot reach the server at {api_base} ({type(error).__name__}): is it running?"
    if isinstance(error, openai.APIStatusError):
        body = error.body if isinstance(error.body, dict) else {}
        detail = body.get("message") or body.get("detail") or error.message
        return f"The server answered {error.status_code}: {' '.join(str(detail).split())}"
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def sidebar():
    with st.sidebar:
        st.text_input("Endpoint", key="api_base")
        st.slider("Earlier turns sent", *RANGES["history_turns"], key="history_turns")
        st.slider("Temperature", *RANGES["temperature"], key="temperature", step=0.05)
        st.slider("top_p", *RANGES["top_p"], key="top_p", step=0.05)
        st.number_input("Max tokens", *RANGES["max_tokens"], key="max_tokens")
        st.toggle("Thinking", key="thinking", help="the model reasons first; the reasoning is shown apart")
        if st.button("Clear the conversation"):
            st.session_state.history = []


def show(message):
    with st.chat_message(message["role"]):
        if message.get("reasoning"):
            with st.expander("Reasoning", expanded=False):
                st.text(message["reasoning"])
        st.markdown(message["content"])


def stream_reply(client, model, messages, state):
    """Stream the answer into the page; returns (answer, reasoning)."""
    extra = {}
    if state.thinking:  # our template's switch, and Qwen3's, for servers that render either
        extra["chat_template_kwargs"] = {"open_thinking": True, "enable_thinking": True}
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, temperature=state.temperature, top_p=state.top_p,
        max_tokens=int(state.max_tokens), extra_body=extra or None)
    answer, reasoning = "", ""
    with st.chat_message("assistant"):
        # The reasoning streams into its own box above the answer, as show() draws it afterwards.
        thought = st.expander("Reasoning", expanded=True).empty() if state.thinking else None
        spoken = st.empty()
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            answer += delta.content or ""
            if reasoning and thought is not None:
                thought.text(reasoning)
            spoken.markdown(answer + "▌")
        spoken.markdown(answer)
    return answer, reasoning


def main(argv=None):
    import openai

    st.set_page_config(page_title="MiniMind chat")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except FlagError as exc:
        st.error(str(exc))
        st.stop()
    if problem := out_of_range(args):
        st.error(problem)
        st.stop()
    state = st.session_state
    for key in ("api_base", "temperature", "top_p", "max_tokens", "history_turns"):
        state.setdefault(key, getattr(args, key))
    state.setdefault("thinking", False)
    state.setdefault("history", [])
    sidebar()
    st.title("MiniMind chat")
    for message in state.history:
        show(message)
    question = st.chat_input("Ask something")
    if not question:
        return
    state.history.append({"role": "user", "content": question})
    show(state.history[-1])
    client = openai.OpenAI(base_url=state.api_base, api_key=args.api_key, max_retries=0, timeout=120)
    try:
        model = args.model or next(iter(client.models.list().data)).id
        answer, reasoning = stream_reply(client, model, turns_to_send(state.history, state.history_turns), state)
    except StopIteration:
        state.history[-1]["unanswered"] = True
        st.error(f"The server at {state.api_base} lists no model: pass --model NAME")
        return
    except openai.OpenAIError as e:
        state.history[-1]["unanswered"] = True  # kept on the page, not sent again
        st.error(one_line(e, state.api_base))
        return
    state.history.append({"role": "assistant", "content": answer, "reasoning": reasoning})


if __name__ == "__main__":  # streamlit run, and Streamlit's AppTest, run it as __main__
    main()
