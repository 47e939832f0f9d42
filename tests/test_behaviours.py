"""The demo behaviours' data and checks (demo/behaviours.py): held-out prompts are never
training prompts, every reference answer passes its own check and no other's, and the
sql check runs the query against the demo database (the reference query is the oracle)."""

from __future__ import annotations

from loraplex.demo.behaviours import BEHAVIOURS, check_json, check_pirate


def test_held_out_prompts_are_kept_apart_from_training():
    for behaviour in BEHAVIOURS:
        train = {e.prompt for e in behaviour.train()}
        held_out = [e.prompt for e in behaviour.held_out()]
        assert len(held_out) >= 20 and len(set(held_out)) == len(held_out)
        assert not train & set(held_out), behaviour.name


def test_every_reference_answer_shows_its_behaviour_and_only_it():
    checks = {b.name: b.checker() for b in BEHAVIOURS}
    for behaviour in BEHAVIOURS:
        for example in behaviour.train() + behaviour.held_out():
            for name, check in checks.items():
                shown = check(example.prompt, example.answer) if name != "sql" else None
                if name == behaviour.name:
                    assert check(example.prompt, example.answer), example
                elif shown is not None:
                    assert not shown, (name, example)


def test_sql_check_compares_rows_with_the_reference_query():
    sql = next(b for b in BEHAVIOURS if b.name == "sql")
    check = sql.checker()
    prompt = "How many customers live in Porto?"
    assert check(prompt, "SELECT COUNT(*) FROM customers WHERE city = 'Porto';")
    assert check(prompt, "select count(id) from customers where city='Porto'")  # same rows
    assert not check(prompt, "SELECT COUNT(*) FROM customers WHERE city = 'Milan';")
    assert not check(prompt, "SELECT COUNT(*) FROM clients;")  # no such table
    assert not check(prompt, "There are 6 customers in Porto.")
    assert not check(prompt, "SELECT 1; DROP TABLE customers;")


def test_format_checks():
    assert check_json('{"answer": "Lima"}') and check_json(' {"answer": 12}\n')
    assert not check_json("Lima") and not check_json('{"city": "Lima"}')
    assert check_pirate("Arr! The capital of Peru be Lima, matey!")
    assert not check_pirate("The capital of Peru is Lima.")
