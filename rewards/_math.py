"""Answer normalisation, number parsing and math-answer equivalence for `accuracy` (not a plugin).

Expressions are parsed with Python's `ast` into a small whitelist (numbers, one-word symbols, + - * / ^, unary signs,
a few functions) and built as sympy expressions; nothing is ever `eval`-ed, and exponents are bounded, so a model's text
cannot run code or blow up. sympy comes with torch; without it only plain numbers are compared.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_LENGTH = 200  # longer answers are not parsed as math
MAX_EXPONENT = 64
MAX_OPS = 60  # larger expressions are not simplified
MAX_FRACTION_DIGITS = 4300  # Python's default limit of int() from text (longer fractions are not read)

# a number written in text; the lookahead (a digit ahead) skips the empty / sign-only matches the rest of the pattern
# allows at every position, so the matches are exactly the digit-holding ones of the pattern without it
_NUMBER = re.compile(r"(?=[-+]?(?:\d|\.\d|[eE][-+]?\d))[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?%?")
# a plain decimal (``42``, ``-0.5``, ``.5``) of at most 15 digits is read as its correctly rounded double, without
# sympy (~0.1 ms an answer); the expression path's 15-digit evaluation can differ from it in the last bit
_PLAIN_DECIMAL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", re.ASCII)
PLAIN_DIGITS = 15
_LATEX = [
    (r"\\%", "%"),
    (r"\\left|\\right|\\!|\\,|\\;|\\:|\\quad|\\displaystyle|\$", ""),
    (r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"((\1)/(\2))"),
    (r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)"),
    (r"\\sqrt\s*(\d+|[a-zA-Z])", r"sqrt(\1)"),
    (r"\\(?:cdot|times)", "*"),
    (r"\\div", "/"),
    (r"\\pi", "pi"),
    (r"\\infty", "oo"),
    (r"\\text\s*\{[^{}]*\}|\\mathrm\s*\{[^{}]*\}|\^\s*\{\\circ\}|\^\\circ|°", ""),
    (r"\{", "("),
    (r"\}", ")"),
    (r"\^", "**"),
]


def normalize_text(text: str, case_sensitive: bool = False) -> str:
    """Strips, collapses white space, drops surrounding quotes / a trailing period, and case-folds."""
    text = " ".join(text.strip().split()).strip("\"'`").rstrip(".").strip()
    return text if case_sensitive else text.casefold()


def _fraction(text: str) -> float | None:
    """The value of `text` when it ends with a fraction ``[-+]<digits> / <digits>`` (white space allowed around the
    slash), as ``re.search(r"([-+]?\\d+)\\s*/\\s*(\\d+)\\s*$", text)`` reads it; None when it does not (or the
    denominator is 0); NaN when it does but the value is not a float (more than `MAX_FRACTION_DIGITS` digits a side,
    Python's own limit for `int` from text, or a quotient beyond the float range).

    Read backwards from the end in one pass (the regex retries every start of a long digit run: quadratic)."""
    head, slash, denominator = text.rpartition("/")
    denominator = denominator.lstrip()
    if not slash or not denominator.isdecimal():
        return None
    head = head.rstrip()
    start = len(head)
    while start > 0 and head[start - 1].isdecimal() and len(head) - start <= MAX_FRACTION_DIGITS:
        start -= 1
    numerator = head[start:]
    if not numerator:
        return None
    if len(numerator) > MAX_FRACTION_DIGITS or len(denominator) > MAX_FRACTION_DIGITS:
        return math.nan
    sign = -1 if start > 0 and head[start - 1] == "-" else 1
    if int(denominator) == 0:
        return None
    try:
        return sign * int(numerator) / int(denominator)
    except OverflowError:
        return math.nan


def parse_number(text: str) -> float | None:
    """The last number written in `text` (``1,234.5``, ``-3``, ``2e3``, ``45%`` -> 0.45, ``3/4`` -> 0.75), or None.

    Linear in the length of `text`: one backward read for a final fraction, one regex pass for the numbers."""
    text = text.replace("\\%", "%").replace("$", "")
    fraction = _fraction(text.strip())
    if fraction is not None:
        return fraction if math.isfinite(fraction) else None
    tokens = _NUMBER.findall(text)
    if not tokens:
        return None
    token = tokens[-1]
    percent = token.endswith("%")
    try:
        value = float(token.rstrip("%").replace(",", ""))
    except ValueError:
        return None
    value = value / 100 if percent else value
    return value if math.isfinite(value) else None


def latex_to_python(text: str) -> str:
    """Rewrites simple LaTeX and math notation as Python syntax (``\\frac{a}{b}`` -> ``((a)/(b))``, ``^`` -> ``**``,
    implicit products ``2x`` -> ``2*x``); keeps only the right-hand side of ``x = ...``."""
    for pattern, replacement in _LATEX:
        text = re.sub(pattern, replacement, text)
    text = text.split("=")[-1].strip()
    text = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", text)  # thousands separators
    if "%" in text:  # (the lookbehind that starts a digit run once, keeping this linear, defeats re's prefix scan)
        text = re.sub(r"(?<!\d)(\d+(?:\.\d+)?)\s*%", r"(\1/100)", text)
    text = re.sub(r"(\d)\s*(?![eE][-+]?\d)([a-zA-Z(])", r"\1*\2", text)
    text = re.sub(r"\)\s*([a-zA-Z\d(])", r")*\1", text)
    return text


_FUNCTIONS = ("sqrt", "log", "ln", "exp", "sin", "cos", "tan", "abs")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _power(base, exponent, sp):
    """``base ** exponent`` with a numeric exponent and a result of at most ~4096 bits."""
    if not exponent.is_number or not exponent.is_real or abs(float(exponent)) > MAX_EXPONENT:
        raise ValueError("exponent too large or not a real number")
    if base.is_number and base != 0 and abs(float(exponent)) * abs(float(sp.log(sp.Abs(base) + 1, 2))) > 4096:
        raise ValueError("power too large")
    return base**exponent


def _build(node: ast.AST, sp):
    """sympy expression of a whitelisted AST node; raises ValueError otherwise."""
    if isinstance(node, ast.Expression):
        return _build(node.body, sp)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return sp.Rational(str(node.value)) if isinstance(node.value, float) else sp.Integer(node.value)
    if isinstance(node, ast.Name):
        constants = {"pi": sp.pi, "e": sp.E, "oo": sp.oo}
        return constants[node.id] if node.id in constants else sp.Symbol(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _build(node.operand, sp)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_build(node.left, sp), _build(node.right, sp), sp)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_build(node.left, sp), _build(node.right, sp))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and len(node.args) == 1 and not node.keywords):
        function = {"ln": sp.log, "abs": sp.Abs}.get(node.func.id) or getattr(sp, node.func.id)
        return function(_build(node.args[0], sp))
    if isinstance(node, ast.Tuple):
        return sp.Tuple(*[_build(item, sp) for item in node.elts])
    raise ValueError(f"unsupported syntax {type(node).__name__}")


def parse_math(text: str):
    """A sympy expression of a simple math answer, or None when it is not one (or sympy is missing)."""
    try:
        import sympy
    except ImportError:
        return None
    source = latex_to_python(text)
    if not source or len(source) > MAX_LENGTH:
        return None
    try:
        return _build(ast.parse(source, mode="eval"), sympy)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, RecursionError, OverflowError):
        return None


def numeric_value(text: str) -> float | None:
    """The value of an answer that is a number or a simple numeric expression (``\\frac{84}{2}``, ``x = 5``,
    ``2\\sqrt{4}``), else the last number written in it (``the answer is 42.``), else None. A plain decimal of at most 15
    digits (``42``, ``-0.5``) is read directly."""
    stripped = text.strip()
    if _PLAIN_DECIMAL.fullmatch(stripped) and sum(c.isdigit() for c in stripped) <= PLAIN_DIGITS:
        return float(stripped)
    expression = parse_math(text)
    if expression is not None and expression.is_number:
        try:
            value = complex(expression.evalf())
        except (TypeError, ValueError, OverflowError):
            value = None
        if value is not None and value.imag == 0 and math.isfinite(value.real):
            return value.real
    return parse_number(text)


def math_equal(answer: str, truth: str, rtol: float = 1e-6) -> bool | None:
    """Whether two math answers are equal (``\\frac{1}{2}`` = ``0.5`` = ``1/2``; ``2x+x`` = ``3x``); None when one of
    them cannot be parsed."""
    a, b = parse_math(answer), parse_math(truth)
    return None if a is None or b is None else expressions_equal(a, b, rtol)


def expressions_equal(a, b, rtol: float = 1e-6) -> bool | None:
    """Whether two parsed answers (`parse_math`) are equal; None when sympy cannot tell."""
    import sympy

    try:
        if isinstance(a, sympy.Tuple) or isinstance(b, sympy.Tuple):
            return isinstance(a, sympy.Tuple) and isinstance(b, sympy.Tuple) and len(a) == len(b) and all(
                math_equal(str(x), str(y), rtol) for x, y in zip(a, b))
        if a.is_number and b.is_number:
            x, y = complex(sympy.N(a)), complex(sympy.N(b))
            return abs(x - y) <= rtol * max(1.0, abs(y))
        if sympy.count_ops(a) + sympy.count_ops(b) > MAX_OPS:
            return None
        return sympy.expand(a - b) == 0 or sympy.simplify(a - b) == 0
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
