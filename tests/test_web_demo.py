"""scripts/web_demo.py against a real server (scripts/serve_openai_api.py on a tiny chat model):
its logic under Streamlit's AppTest, and the page itself in headless Chromium driven by Selenium."""
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

NO_EXTRA = "the serving extra is not installed: pip install -r requirements-serve.txt"
openai = pytest.importorskip("openai", reason=NO_EXTRA)
pytest.importorskip("streamlit", reason=NO_EXTRA)
from streamlit.testing.v1 import AppTest  # noqa: E402

from scripts.dev.launching import PYTHON  # noqa: E402
from tests.support.serving import WEB_DEMO, free_port, running, served_tiny_chat  # noqa: E402

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_chat(tmp_path_factory.mktemp("web_demo")) as served:
        yield served


def greedy(served, messages):
    return served.client.chat.completions.create(model=served.model, messages=messages, temperature=0,
                                                 max_tokens=MAX_TOKENS).choices[0].message.content


def page(url, turns=4):
    app = AppTest.from_file(str(WEB_DEMO), default_timeout=120)
    app.session_state["api_base"] = url
    app.session_state["temperature"] = 0.0
    app.session_state["max_tokens"] = MAX_TOKENS
    app.session_state["history_turns"] = turns
    return app.run()


def ask(app, question):
    app.chat_input[0].set_value(question).run()
    assert not app.exception, app.exception
    return app


def said(app) -> list[tuple[str, str]]:
    return [(m.name, "".join(md.value for md in m.markdown)) for m in app.chat_message]


def test_the_page_answers_and_keeps_the_conversation(served):
    app = ask(page(served.url), "What is 7?")
    first = greedy(served, [{"role": "user", "content": "What is 7?"}])
    assert said(app) == [("user", "What is 7?"), ("assistant", first)] and not app.error
    ask(app, "Tell me a story")
    both = [{"role": "user", "content": "What is 7?"}, {"role": "assistant", "content": first},
            {"role": "user", "content": "Tell me a story"}]
    assert said(app) == [("user", "What is 7?"), ("assistant", first), ("user", "Tell me a story"),
                         ("assistant", greedy(served, both))]


def test_the_turn_control_says_how_much_history_is_sent(served):
    """With 0 earlier turns the second question is answered as if asked alone; with 1, after the first."""
    first = [{"role": "user", "content": "What is 7?"}, {"role": "assistant", "content": ""}]
    picked = None
    for question in ("Tell me a story", "What is 12?", "你好", "Why?"):
        alone = greedy(served, [{"role": "user", "content": question}])
        first[1]["content"] = greedy(served, first[:1])
        after = greedy(served, [*first, {"role": "user", "content": question}])
        if alone != after:
            picked = question, alone, after
            break
    assert picked, "the tiny model answers every question the same with or without history"
    question, alone, after = picked
    for turns, expected in ((0, alone), (1, after)):
        app = ask(ask(page(served.url, turns), "What is 7?"), question)
        assert said(app)[-1] == ("assistant", expected), turns


def test_thinking_shows_the_reasoning_apart_from_the_answer(served):
    app = page(served.url)
    app.session_state["thinking"] = True
    ask(app, "What is 5?")
    expected = served.client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "What is 5?"}], temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"chat_template_kwargs": {"open_thinking": True}}).choices[0].message
    assert expected.reasoning_content  # the tiny model reasons when asked to
    reply = app.chat_message[-1]
    assert [e.label for e in reply.expander] == ["Reasoning"]
    assert reply.expander[0].text[0].value.strip() == expected.reasoning_content.strip()  # st.text trims it
    assert "".join(md.value for md in reply.markdown) == expected.content


def test_errors_are_one_line_and_the_conversation_stays(served):
    app = ask(page(served.url), "What is 7?")
    kept = said(app)
    app.session_state["api_base"] = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    ask(app, "Are you there?")
    assert len(app.error) == 1 and "Cannot reach the server" in app.error[0].value
    assert "\n" not in app.error[0].value
    assert said(app) == [*kept, ("user", "Are you there?")]
    app.session_state["api_base"] = served.url
    app.session_state["max_tokens"] = 32768  # with the prompt, over the model's context: the server answers 400
    ask(app, "What is 3?")
    assert len(app.error) == 1 and app.error[0].value.startswith("The server answered 400: ")
    assert "context" in app.error[0].value and "\n" not in app.error[0].value
    app.session_state["max_tokens"] = MAX_TOKENS
    ask(app, "What is 12?")  # the two unanswered questions are not sent again
    assert not app.error
    assert said(app)[-1] == ("assistant", greedy(served, [
        {"role": "user", "content": "What is 7?"}, {"role": "assistant", "content": kept[1][1]},
        {"role": "user", "content": "What is 12?"}]))


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "3"], "--temperature 3.0 is outside the sidebar's range [0.0, 2.0]"),
    (["--history_turns", "30"], "--history_turns 30 is outside the sidebar's range [0, 20]"),
    (["--top_p", "nan"], "--top_p nan is outside"),
    (["--temperature", "abc"], "argument --temperature: invalid float value: 'abc'"),  # argparse's own words
])
def test_a_flag_the_sidebar_cannot_show_is_one_line(monkeypatch, flags, says):
    """Streamlit would show its own error, with a traceback, for a slider started outside its range."""
    monkeypatch.setattr(sys, "argv", ["web_demo.py", *flags])
    app = AppTest.from_file(str(WEB_DEMO), default_timeout=60).run()
    assert not app.exception, app.exception
    assert len(app.error) == 1 and says in app.error[0].value
    assert "\n" not in app.error[0].value and not app.chat_input


def browser_missing() -> str | None:
    if os.environ.get("CHROMIUM_INSTALL_ERROR"):
        return os.environ["CHROMIUM_INSTALL_ERROR"]
    for name in ("chromium", "chromedriver"):
        if not shutil.which(name):
            return f"{name} is not installed (apt-get install chromium chromium-driver; .ci/run does)"
    return None


def test_the_page_in_a_real_browser_streams_a_reply(served, tmp_path):
    missing = browser_missing()
    if missing:
        pytest.skip(f"no headless Chromium: {missing}")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    port = free_port()
    # No --server.address: the repository's .streamlit/config.toml, read in the folder the page
    # starts in (the repository's, as the README has it), keeps it on this machine.
    argv = [PYTHON, "-m", "streamlit", "run", str(WEB_DEMO), "--server.headless", "true", "--server.port", str(port),
            "--", "--api_base", served.url, "--temperature", "0", "--max_tokens", "300"]
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    with running(argv, tmp_path / "streamlit.log", f"http://127.0.0.1:{port}/_stcore/health", timeout=120):
        assert listening_addresses(port) == {"127.0.0.1"}
        os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not fetch a driver
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
        try:
            driver.get(f"http://127.0.0.1:{port}")
            box = wait(lambda: driver.find_element(By.CSS_SELECTOR, "[data-testid=stChatInputTextArea]"), 60)
            box.send_keys("Tell me a story", Keys.ENTER)
            lengths = set()

            def answer():
                messages = driver.find_elements(By.CSS_SELECTOR, "[data-testid=stChatMessageContent]")
                text = messages[-1].text if len(messages) >= 2 else ""
                lengths.add(len(text))
                return text if text and "▌" not in text else None
            text = wait(answer, 120)
            driver.save_screenshot(str(tmp_path / "web_demo.png"))
        finally:
            driver.quit()
    expected = served.client.chat.completions.create(model=served.model, temperature=0, max_tokens=300, messages=[
        {"role": "user", "content": "Tell me a story"}]).choices[0].message.content
    assert " ".join(text.split()) == " ".join(expected.split())
    assert len(lengths - {0}) >= 2, f"the reply did not grow on the page as it streamed: {lengths}"
    assert (tmp_path / "web_demo.png").stat().st_size > 1000


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on `port` (Linux's /proc/net/tcp and tcp6)."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                # Each 32-bit word of the address is in the host's (little-endian) byte order.
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, 2 * width, 8))
                found.add(str(ipaddress.ip_address(raw)))
    return found


def wait(find, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = find()
            if found:
                return found
        except Exception:  # not there yet (Selenium's NoSuchElement, a stale element)
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"not on the page after {timeout} s")
        time.sleep(0.05)
