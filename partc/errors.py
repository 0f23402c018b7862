"""User-facing errors.

A `PartcError` carries one line for the user. The CLI prints it as ``error: <line>`` and exits with code 2,
without a traceback. Internal invariants use `assert`; everything a user can cause raises `PartcError`.
"""


class PartcError(ValueError):
    """An error caused by user input (model file, options, plan file). The message is one line."""


def article(word: str) -> str:
    """``a WORD`` or ``an WORD``, by the word's first letter (a vowel takes "an": "an Albert layer")."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of `e`'s message, at most `limit` characters, cut at a word boundary (with "...")."""
    line = (str(e).strip().splitlines() or [""])[0]
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0]
    return cut.rstrip(" ,;:") + " ..."
