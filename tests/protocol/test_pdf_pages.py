"""A PDF is billed by its pages, not its bytes: a budget holds it so. A 40-page PDF that
repeats one compressed content stream is 7 KB and ~100,000 tokens, and was held at 1,700:
ten of them at once spent $3.24 of a $0.10 budget."""

from __future__ import annotations

import base64
import zlib

import orjson
import pytest

from nexus.estimates import PDF_PAGE_TOKENS, UNSAID_PAGES, _pdf_tokens, prompt_estimate
from nexus.protocol.anthropic_messages import parse_messages_request
from nexus.protocol.openai_chat import parse_chat_request
from nexus.protocol.pdf_pages import MAX_PAGES, pdf_pages


def pdf(pages: int, packed: bool = False) -> bytes:
    """A PDF of ``pages`` pages sharing one content stream; ``packed``: its objects in a
    compressed object stream (PDF 1.5), where no ``/Type /Page`` shows in the bytes."""
    text = zlib.compress(b"BT /F1 9 Tf 36 800 Td (Quarterly revenue rose.) Tj ET\n" * 60, 9)
    kids = b" ".join(b"%d 0 R" % (4 + i) for i in range(pages))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages,
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(text) + text + b"\nendstream",
    ]
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 842] /Contents 3 0 R >>"
    objects += [page] * pages
    if packed:
        inner = zlib.compress(b"\n".join(objects[:2] + objects[3:]))
        objects = [
            b"<< /Type /ObjStm /N %d /Length %d /Filter /FlateDecode >>\nstream\n"
            % (pages + 2, len(inner))
            + inner
            + b"\nendstream",
            objects[2],
        ]
    out = b"%PDF-1.5\n" + b"".join(
        b"%d 0 obj\n%s\nendobj\n" % (n, o) for n, o in enumerate(objects, 1)
    )
    return out + b"%%EOF\n"


def test_pages_are_counted_plain_and_in_object_streams() -> None:
    assert pdf_pages(pdf(40)) == 40
    assert pdf_pages(pdf(40, packed=True)) == 40
    assert pdf_pages(b"%PDF-1.4 nothing that says") is None
    assert pdf_pages(b"/Type /Pages /Count 999999999") == MAX_PAGES
    bomb = zlib.compress(b"\0" * 200_000_000)
    stream = b"<< /Type /ObjStm >>\nstream\n" + bomb + b"\nendstream"
    assert pdf_pages(stream * 3) is None  # inflated within the bound, then given up


def request_with(data: bytes) -> dict[str, object]:
    url = "data:application/pdf;base64," + base64.b64encode(data).decode()
    part = {"type": "file", "file": {"filename": "a.pdf", "file_data": url}}
    return {"model": "m", "messages": [{"role": "user", "content": [part]}]}


def test_a_pdf_is_estimated_by_its_pages_and_one_that_does_not_say_at_the_most() -> None:
    small = parse_chat_request(orjson.dumps(request_with(pdf(40))))
    assert len(pdf(40)) < 20_000
    assert prompt_estimate(small) >= 40 * PDF_PAGE_TOKENS
    unsaid = parse_chat_request(orjson.dumps(request_with(b"%PDF-1.4 " + b"x" * 100)))
    assert prompt_estimate(unsaid) >= UNSAID_PAGES * PDF_PAGE_TOKENS


def test_a_documents_context_and_title_are_estimated() -> None:
    """A 1-byte document with a 700 KB ``context`` was held at 7 tokens."""
    document = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "x"},
        "context": "c" * 700_000,
    }
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [document]}]}
    assert prompt_estimate(parse_messages_request(orjson.dumps(body))) > 700_000 // 4
    content = {"type": "content", "content": [{"type": "text", "text": "t" * 400_000}]}
    document = {"type": "document", "source": content}
    body["messages"] = [{"role": "user", "content": [document]}]
    assert prompt_estimate(parse_messages_request(orjson.dumps(body))) > 400_000 // 4


def test_a_pdf_in_a_tool_result_is_estimated_by_its_pages() -> None:
    """Claude Code sends a PDF it read as a document in a tool result."""
    data = base64.b64encode(pdf(40)).decode()
    source = {"type": "base64", "media_type": "application/pdf", "data": data}
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "document", "source": source}],
    }
    turns = [
        {"role": "user", "content": "read it"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
        },
        {"role": "user", "content": [result]},
    ]
    body = {"model": "m", "max_tokens": 1, "messages": turns}
    assert prompt_estimate(parse_messages_request(orjson.dumps(body))) >= 40 * PDF_PAGE_TOKENS


def test_a_page_in_the_plain_bytes_does_not_hide_those_packed() -> None:
    """An update that writes page 1 plainly (or a comment that names a page) left the other
    39, packed in an object stream, uncounted: the 7 KB budget hole again."""
    packed = pdf(40, packed=True)
    assert pdf_pages(packed.replace(b"%PDF-1.5\n", b"%PDF-1.5\n%/Type /Page\n")) >= 40


def test_the_object_streams_are_read_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many stream markers and one end: each marker's search ran to the end and copied the
    rest, the square of the size (a 2 MB body held the event loop 42 s)."""
    calls: list[int] = []
    real = zlib.decompressobj

    def counted(*args: object) -> object:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(zlib, "decompressobj", counted)
    data = b"%PDF-1.5\n" + b"/Type/ObjStm stream\n" * 20_000 + b"endstream\n"
    assert pdf_pages(data) is None
    assert len(calls) == 1


def test_a_pdf_is_never_counted_as_another_freed_before_it() -> None:
    """The counts were kept by the text's ``id()`` and its ends: a 1,000-page PDF sent after
    a 1-page one of the same length and ends (padded in its middle) took that one's freed
    address, and was held, and charged, at one page."""
    big = pdf(1000)
    small = pdf(1)
    at = small.index(b"endobj\n") + 7  # after the catalog, a comment to the big one's length
    small = small[:at] + b"%" + b"x" * (len(big) - len(small) - 2) + b"\n" + small[at:]
    assert len(small) == len(big) and small[-48:] == big[-48:] and small[:48] == big[:48]
    for _ in range(20):
        text = base64.b64encode(small).decode()
        assert _pdf_tokens(text) == PDF_PAGE_TOKENS
        del text
        text = base64.b64encode(big).decode()
        assert _pdf_tokens(text) == 1000 * PDF_PAGE_TOKENS
        del text
