"""The planner's HiGHS driver (milp._solve_highs) against exhaustive enumeration on small random MILPs."""

import itertools
import random

import pulp
import pytest

from lightning_moe.policy import milp

TOL = 1e-6  # absolute tolerance on objectives (integer data, small coefficients)


def random_milp(rng: random.Random):
    """A small random MILP: 3 integer variables in awkward boxes, one continuous, mixed row senses, either sense."""
    sense = rng.choice((pulp.LpMaximize, pulp.LpMinimize))
    prob = pulp.LpProblem("t", sense)
    new = prob.add_variable if hasattr(prob, "add_variable") else pulp.LpVariable  # PuLP >= 3.3 / older
    boxes = [(rng.randint(-3, 0), rng.randint(1, 4)) for _ in range(3)]
    xs = [new(f"x{i}", lo, hi, cat="Integer") for i, (lo, hi) in enumerate(boxes)]
    y = new("y", 0, rng.randint(1, 5))  # continuous: its optimum is at a row or bound, given the xs
    prob += pulp.lpSum(rng.randint(-5, 5) * x for x in xs) + rng.randint(-3, 3) * y + rng.randint(-9, 9)
    rows = []
    for k in range(rng.randint(1, 4)):
        a, b, c = [rng.randint(-4, 4) for _ in xs], rng.randint(-2, 2), rng.randint(-6, 6)
        op = rng.choice(("<=", ">=", "=="))
        expr = pulp.lpSum(ai * x for ai, x in zip(a, xs)) + b * y
        prob += (expr <= c if op == "<=" else expr >= c if op == ">=" else expr == c), f"r{k}"
        rows.append((a, b, c, op))
    return prob, boxes, y.upBound, rows, sense


def brute_force(prob, boxes, y_hi, rows, sense):
    """Best objective over every integer point, with the continuous y optimized exactly by an LP in one variable."""
    obj = prob.objective
    names = [f"x{i}" for i in range(3)]
    coef = {v.name: a for v, a in obj.items()}
    best = None
    for pt in itertools.product(*(range(lo, hi + 1) for lo, hi in boxes)):
        lo, hi, ok = 0.0, float(y_hi), True
        for a, b, c, op in rows:  # each row bounds y (or holds or fails outright when b == 0)
            r = c - sum(ai * xi for ai, xi in zip(a, pt))
            lo_r, hi_r = ((-1e18, 1e18) if b == 0 else sorted((r / b, r / b)) if op == "==" else
                          ((-1e18, r / b) if (op == "<=") == (b > 0) else (r / b, 1e18)))
            if b == 0 and not (0 <= r if op == "<=" else 0 >= r if op == ">=" else r == 0):
                ok = False
            lo, hi = max(lo, lo_r), min(hi, hi_r)
        if not ok or lo > hi + 1e-12:
            continue
        cy = coef.get("y", 0.0)
        ys = hi if (cy > 0) == (sense == pulp.LpMaximize) else lo
        val = sum(coef.get(n, 0.0) * xi for n, xi in zip(names, pt)) + cy * ys + obj.constant
        if best is None or (val > best if sense == pulp.LpMaximize else val < best):
            best = val
    return best


@pytest.mark.parametrize("seed", range(40))
def test_highs_driver_equals_enumeration(seed):
    prob, boxes, y_hi, rows, sense = random_milp(random.Random(seed))
    want = brute_force(prob, boxes, y_hi, rows, sense)
    found, optimal, status = milp._solve_highs(prob, 10.0)
    if want is None:
        assert not found and not optimal, status
        return
    assert found and optimal, status
    assert float(pulp.value(prob.objective)) == pytest.approx(want, abs=TOL), (seed, status)
    for v in prob.variables():  # the solution written back is a feasible point: bounds, integrality, every row
        assert v.lowBound - TOL <= v.varValue <= v.upBound + TOL
        if v.cat == pulp.LpInteger:
            assert abs(v.varValue - round(v.varValue)) <= TOL
    for a, b, c, op in rows:
        lhs = sum(ai * float(prob.variablesDict()[f"x{i}"].varValue) for i, ai in enumerate(a))
        lhs += b * prob.variablesDict()["y"].varValue
        assert (lhs <= c + TOL if op == "<=" else lhs >= c - TOL if op == ">=" else abs(lhs - c) <= TOL), (seed, op)
