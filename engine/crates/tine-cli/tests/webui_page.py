"""The chat page of `tine serve` in a real headless Chromium (Playwright driving Debian's
chromium): run by tine-cli's `the_chat_page_works_in_a_real_browser` with a server that needs
the API key KEY and drafts with n-gram speculation.

    python webui_page.py http://127.0.0.1:PORT KEY SCREENSHOT.png

Checks, as a user would see them: the page asks for the key and says so when a wrong one is
given; a message gets a reply whose text arrives in pieces while it streams; the reply shows
its tokens per second and the drafted/accepted counts, with accepted drafts marked; a reply can
be stopped; the speculation menu lists the server's drafters and off drafts nothing; a reload finds the conversation; the server's errors show in words. Exits non-zero
with the reason on the first failure.
"""

import os
import shutil
import sys
import time

from playwright.sync_api import expect, sync_playwright

BASE, KEY, SHOT = sys.argv[1], sys.argv[2], sys.argv[3]
TIMEOUT = 60_000  # ms: a reply of the real model on 2 shared cores


def chromium_path():
    for name in (os.environ.get("TINE_CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    sys.exit("no chromium on PATH (apt-get install chromium)")


def give_key(page, key):
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible(timeout=TIMEOUT)
    page.fill("#key-input", key)
    page.click("#key-ok")


def last_reply(page):
    return page.locator(".msg.assistant").last


def send(page, text):
    page.fill("#input", text)
    page.press("#input", "Enter")


with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox", "--disable-gpu"])
    ctx = browser.new_context(viewport={"width": 1180, "height": 760})
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(BASE + "/")
    expect(page).to_have_title("Tine")

    # A wrong key is refused in words, the right one lets the page in.
    give_key(page, "not-the-key")
    expect(page.locator("#key-error")).to_contain_text("not accepted", timeout=TIMEOUT)
    page.fill("#key-input", KEY)
    page.click("#key-ok")
    expect(page.locator("#model")).to_contain_text("Model:", timeout=TIMEOUT)

    # Greedy, so that the n-gram drafts of a repetitive prompt are accepted.
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "96")
    page.click("#settings summary")

    # A reply streams: its text is seen growing while the Stop button is up.
    send(page, "Count from one to twenty in words, separated by commas: one, two, three, four, five, six, seven,")
    expect(page.locator("#send")).to_have_text("Stop", timeout=TIMEOUT)
    reply = last_reply(page).locator(".body")
    seen = set()
    deadline = time.time() + 120
    while time.time() < deadline and page.locator("#send").inner_text() == "Stop":
        seen.add(len(reply.inner_text()))
        time.sleep(0.02)
    expect(page.locator("#send")).to_have_text("Send", timeout=TIMEOUT)
    final = reply.inner_text()
    if not final.strip():
        sys.exit("the reply is empty")
    partial = {n for n in seen if 0 < n < len(final)}
    if len(partial) < 2:
        sys.exit(f"no streamed text seen before the reply ended (lengths seen: {sorted(seen)}, final {len(final)})")
    stats = last_reply(page).locator(".stats").inner_text()
    if "tokens/s" not in stats or "drafted" not in stats:
        sys.exit(f"the reply's statistics lack the rate or the draft counts: {stats!r}")
    if last_reply(page).locator(".draft").count() == 0:
        sys.exit(f"no accepted draft marked ({stats!r})")

    # The speculation menu lists what this server offers a request (`/props`): its own drafter,
    # off, and n-grams; off drafts nothing.
    page.click("#settings summary")
    options = page.locator("#speculation option").all_inner_texts()
    if options != ["as the server runs (ngram)", "off", "ngram"]:
        sys.exit(f"the speculation menu offers {options}")
    page.select_option("#speculation", "none")
    page.click("#settings summary")
    send(page, "Count from one to twenty in words, separated by commas: one, two, three, four, five, six, seven,")
    expect(page.locator("#send")).to_have_text("Stop", timeout=TIMEOUT)
    expect(page.locator("#send")).to_have_text("Send", timeout=TIMEOUT)
    stats = last_reply(page).locator(".stats").inner_text()
    if "tokens/s" not in stats or "drafted" in stats:
        sys.exit(f"a reply with speculation off: {stats!r}")
    page.click("#settings summary")
    page.select_option("#speculation", "server")
    page.click("#settings summary")

    # A reply can be stopped.
    page.click("#settings summary")
    page.fill("#max-tokens", "2000")
    page.click("#settings summary")
    send(page, "Write a long story about a lighthouse keeper.")
    expect(page.locator("#send")).to_have_text("Stop", timeout=TIMEOUT)
    expect(last_reply(page).locator(".body")).not_to_have_text("", timeout=TIMEOUT)
    page.click("#send")
    expect(page.locator("#send")).to_have_text("Send", timeout=TIMEOUT)
    expect(last_reply(page).locator(".stats")).to_contain_text("stopped", timeout=TIMEOUT)

    # The conversation survives a reload (the key stays for the session).
    page.reload()
    expect(page.locator("#conversations li")).to_have_count(1, timeout=TIMEOUT)
    expect(page.locator("#conversations li").first).to_contain_text("Count from one")
    expect(page.locator(".msg.user")).to_have_count(3, timeout=TIMEOUT)
    expect(page.locator(".msg.assistant").first.locator(".body")).to_have_text(final, timeout=TIMEOUT)

    # The server's errors show in words: a request over the context is refused with its reason.
    page.click("#new-chat")
    page.click("#settings summary")
    page.fill("#max-tokens", "96")
    page.click("#settings summary")
    send(page, "word " * 9000)
    expect(last_reply(page).locator(".error")).to_contain_text("HTTP 400", timeout=TIMEOUT)
    expect(page.locator("#conversations li")).to_have_count(2)

    # Rendering, on a reply made up here: Markdown with a code block whose first line was an
    # accepted draft, a reply that tries to run script, reasoning folded away, a tool call.
    got = page.evaluate(
        """() => {
        const msg = {role: "assistant", content: "", reasoning: "I should answer.",
          tool_calls: [{type: "function", function: {name: "get_weather", arguments: '{"city":"Paris"}'}}],
          pieces: [{text: "Here is **code**:\\n\\n", draft: false}, {text: "```python\\nprint(1)\\n", draft: true},
                   {text: "```\\n<img src=x onerror=window.__pwned=1><script>window.__pwned=2</script>", draft: false}]};
        const el = renderMessage(msg);
        document.body.append(el);
        const code = el.querySelector("pre code");
        return {
          strong: el.querySelector(".body strong")?.textContent,
          code: code?.textContent, lang: code?.className, draftInCode: !!code?.querySelector(".draft"),
          markers: /[\\uE000\\uE001]/.test(el.innerHTML), onerror: !!el.querySelector("[onerror]"),
          script: !!el.querySelector("script"),
          reasoningOpen: el.querySelector("details.reasoning")?.open, reasoning: el.querySelector("details.reasoning div")?.textContent,
          tool: el.querySelector(".tool-call")?.textContent,
        };
    }"""
    )
    want = {"strong": "code", "code": "print(1)\n", "lang": "language-python", "draftInCode": True, "markers": False, "onerror": False, "script": False,
            "reasoningOpen": False, "reasoning": "I should answer.", "tool": 'Tool call: get_weather{"city":"Paris"}'}
    if got != want:
        sys.exit(f"rendering: got {got}, want {want}")
    page.wait_for_timeout(200)
    if page.evaluate("() => window.__pwned"):
        sys.exit("a reply ran script")
    page.reload()

    # The picture for the README: the first conversation.
    page.locator("#conversations li button.open").nth(1).click()
    expect(page.locator(".msg.user")).to_have_count(3)
    page.screenshot(path=SHOT)
    if errors:
        sys.exit(f"script errors on the page: {errors}")
    browser.close()
print("webui: all checks passed")
