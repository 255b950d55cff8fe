"""Arithmetic word problems for the calculator environment (:mod:`rlhf_train.envs.calculator`), generated from a
seeded :class:`random.Random`: one of a few templates, filled with 2- and 3-digit numbers chosen so that every
answer is a whole number (divisions come out exact, differences are positive). Each template needs one to three
operations (:data:`TEMPLATES`: the template and its count); ``max_steps`` keeps those of at most that many. The
numbers are large enough that a small model gets them wrong in its head and right with the tool.
"""
from __future__ import annotations

import random
from typing import Any, Callable


def _crates(r: random.Random):
    per, crates = r.randint(12, 99), r.randint(12, 99)
    return f"A crate holds {per} bottles. How many bottles are in {crates} crates?", per * crates


def _library(r: random.Random):
    novels, comics = r.randint(120, 899), r.randint(120, 899)
    return f"A library has {novels} novels and {comics} comics. How many books does it have?", novels + comics


def _tank(r: random.Random):
    full, used = r.randint(300, 999), r.randint(100, 290)
    return f"A tank holds {full} liters of water and {used} liters are used. How many liters are left?", full - used


def _sell(r: random.Random):
    boxes, per, sold = r.randint(12, 60), r.randint(12, 48), r.randint(10, 200)
    return (f"A shop has {boxes} boxes with {per} apples in each box. It sells {sold} apples. "
            f"How many apples are left?", boxes * per - sold)


def _share(r: random.Random):
    people, each = r.randint(3, 24), r.randint(12, 95)
    return (f"{people * each} stickers are shared equally among {people} children. How many stickers does each "
            f"child get?", each)


def _trip(r: random.Random):
    speed, hours, extra = r.randint(35, 95), r.randint(3, 12), r.randint(10, 150)
    return (f"A bus drives at {speed} km per hour for {hours} hours, then {extra} km more. How many km does it "
            f"drive in all?", speed * hours + extra)


def _save(r: random.Random):
    weekly, weeks, spent = r.randint(15, 85), r.randint(6, 30), r.randint(20, 300)
    total = weekly * weeks
    spent = min(spent, total - 1)
    return (f"Maria saves {weekly} dollars every week for {weeks} weeks and then spends {spent} dollars. How many "
            f"dollars does she have left?", total - spent)


def _rows(r: random.Random):
    rows, seats, empty = r.randint(11, 45), r.randint(14, 38), r.randint(5, 90)
    return (f"A theatre has {rows} rows of {seats} seats. {empty} seats are empty. How many seats are taken?",
            rows * seats - empty)


def _pack(r: random.Random):
    per, boxes, loose = r.randint(6, 24), r.randint(15, 70), r.randint(1, 5)
    loose = min(loose, per - 1)
    return (f"A baker packs {per * boxes + loose} cookies into boxes of {per}. How many full boxes does he get?",
            boxes)


def _farm(r: random.Random):
    hens, eggs, days = r.randint(12, 60), r.randint(2, 6), r.randint(7, 31)
    return (f"A farm has {hens} hens. Each hen lays {eggs} eggs a week. How many eggs do they lay in {days} "
            f"weeks?", hens * eggs * days)


def _tickets(r: random.Random):
    adults, children, price_a, price_c = r.randint(20, 150), r.randint(20, 150), r.randint(12, 40), r.randint(5, 11)
    return (f"{adults} adult tickets cost {price_a} dollars each and {children} child tickets cost {price_c} "
            f"dollars each. How many dollars do all the tickets cost?", adults * price_a + children * price_c)


TEMPLATES: list[tuple[Callable[[random.Random], tuple[str, int]], int]] = [
    (_sell, 2), (_share, 1), (_trip, 2), (_save, 2), (_rows, 2), (_pack, 1), (_farm, 2), (_tickets, 3), (_crates, 1),
    (_library, 1), (_tank, 1)]  # each template and the operations its answer needs


def problem(r: random.Random, max_steps: int = 3) -> dict[str, Any]:
    """One problem of a template that needs at most ``max_steps`` operations: ``{"question": str, "answer": int}``."""
    question, answer = r.choice([t for t, steps in TEMPLATES if steps <= max_steps])(r)
    return {"question": question, "answer": int(answer)}
