"""What streaming parsers share: text that may still be the start of a marker is held back until it is known."""


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper start of one of `markers` (0: none): that much
    must wait for the next text before it is shown, as it may yet become the marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(where the first of `markers` in `text` starts, which one) or (-1, "")."""
    found, which = -1, ""
    for marker in markers:
        at = text.find(marker)
        if at != -1 and (found == -1 or at < found):
            found, which = at, marker
    return found, which
