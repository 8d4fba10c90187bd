"""README's "Read it in this order" against the code, followed as Python follows it.

    python -m tools.reading        per concept: its budget, the lines README lists, the lines a
                                   reader must open, what it reaches that a later concept lists
                                   or no concept lists; then where each unlisted one goes

A reader follows each listed definition one level into every project definition it names: a
call or a build (`f(...)`, `module.f(...)`), a class or function handed as a value (an argument,
a default, `A if c else B`), a base class (what `self.x` and `super()` run), a layer spec's field
(`spec.norm`: what gpt.local_spec and gpt.fast_spec put there; what a layout puts there, TP's
and CP's spec functions, is listed in that layout's concept). A primitive (README's list, at
most 10 lines) is not listed, but what it names is followed as if its caller named it. The roots
(ROOTS) are what a run starts from. Skipped by rule: the fast forms (what gpt.fast_spec puts in
the spec beyond the local spec), the data pipeline (DATA_PIPELINE) and the folders a first
reading skips (SKIPPED_FOLDERS). test_reading_order_is_the_real_path holds README to this.
Reads the files only (ast): nothing of the project is imported.
"""
import ast
import functools
import os
import re

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIPPED_FOLDERS = ("settings", "formats", "backends", "tools", "instruments")
DATA_PIPELINE = ("data", "tokenizer")   # its own walkthrough: docs/training.md
SPEC_BUILDERS = ("gpt.local_spec", "gpt.fast_spec")     # the plain forms; the fast ones
ROOTS = ("train.pretrain",)          # what `bash run.sh` runs after reading its flags: the loop
# each concept's budget in lines, README's order (a reader should open at most ~15% beyond)
BUDGETS = {"The model, one process": 550, "Flash attention": 170,
           "A training step, one process": 450, "Process groups and collectives": 290,
           "Tensor + sequence parallel": 300, "The optimizer's update": 300,
           "Data parallel + distributed optimizer": 400, "Pipeline, 1F1B and interleaved": 300,
           "Context parallel": 250, "Routing tokens to experts": 250, "Experts": 400,
           "Megatron's overlap": 220, "FSDP, ZeRO-2 and ZeRO-3": 300,
           "Building and the loop": 720}
ITEM = re.compile(r"^\d+\. \*\*(.+?)\*\* \((\d+) lines\)\.(.*?);\s+proof:", re.M | re.S)
LISTED = re.compile(r"`(\w+\.[\w.]+)` \((\d+)\)")


def reading_order(readme=None):
    """({concept: (stated total, [(module.name, stated lines)])}, the primitives' names) of
    README's "Read it in this order"."""
    text = readme or open(os.path.join(PROJECT, "README.md")).read()
    section = text.split("## Read it in this order")[1].split("\n## ")[0]
    concepts = {name: (int(total), [(q, int(n)) for q, n in LISTED.findall(" ".join(body.split()))])
                for name, total, body in ITEM.findall(section)}
    primitives = re.findall(r"`(\w+\.\w+)`", section.split("Primitives")[1].split("\n\n")[0])
    return concepts, primitives


@functools.lru_cache(maxsize=None)
def module_files():
    """{a module's short name (`config`, `memory`): its file relative to PROJECT}: the modules
    at the top and in the folders."""
    files = {}
    for folder in ("", *SKIPPED_FOLDERS):
        if os.path.isdir(os.path.join(PROJECT, folder)):
            files.update({name[:-3]: os.path.join(folder, name)
                          for name in sorted(os.listdir(os.path.join(PROJECT, folder)))
                          if name.endswith(".py") and name != "__init__.py"
                          and not name.startswith("test_") and name != "conftest.py"})
    return files


@functools.lru_cache(maxsize=None)
def tree(module):
    return ast.parse(open(os.path.join(PROJECT, module_files()[module])).read())


def top_definitions(module):
    """{name: node} of a module's top-level functions and classes."""
    return {n.name: n for n in tree(module).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def definition_node(qualified):
    """The ast node of `module.Name` or `module.Class.method`."""
    module, *path = qualified.split(".")
    node = tree(module)
    for name in path:
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                    and n.name == name)
    return node


def lines(qualified):
    """A definition's length in lines, its decorators included (inspect.getsourcelines')."""
    node = definition_node(qualified)
    return node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1


def is_definition(qualified):
    module, _, name = qualified.partition(".")
    return module in module_files() and name in top_definitions(module)


@functools.lru_cache(maxsize=None)
def module_names(module):
    """{a name used in `module`: the project definition ("module.Name") or the module's short
    name it stands for}: its own top-level functions and classes and what it imports."""
    by_path = {path[:-3].replace(os.sep, "."): name for name, path in module_files().items()}
    names = {name: f"{module}.{name}" for name in top_definitions(module)}
    for node in tree(module).body:
        if isinstance(node, ast.Import):
            names.update({a.asname or a.name: by_path[a.name] for a in node.names
                          if a.name in by_path})
        elif isinstance(node, ast.ImportFrom) and node.module in by_path:
            names.update({a.asname or a.name: f"{by_path[node.module]}.{a.name}"
                          for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update({a.asname or a.name: by_path[f"{node.module}.{a.name}"]
                          for a in node.names if f"{node.module}.{a.name}" in by_path})
    return names


def local_names(node):
    """The names a definition binds itself (arguments, assignments): they shadow the module's."""
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
             and isinstance(n.ctx, ast.Store)}
    return bound | {a.arg for n in ast.walk(node) if isinstance(n, ast.arguments)
                    for a in n.posonlyargs + n.args + n.kwonlyargs + [n.vararg, n.kwarg] if a}


def named_definitions(node, module):
    """The project definitions `node`'s code names: `Name` or `module.Name`, called, built,
    handed as a value, a branch of `A if c else B`, a base class or a default."""
    names, local, found = module_names(module), local_names(node), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local:
            target = names.get(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) \
                and n.value.id not in local and names.get(n.value.id) in module_files():
            target = f"{names[n.value.id]}.{n.attr}"
        else:
            continue
        if target and is_definition(target):
            found.add(target)
    return found


@functools.lru_cache(maxsize=None)
def spec_fields():
    """{a layer spec field: ({what gpt.local_spec puts there}, {what gpt.fast_spec adds})}."""
    put = []
    for builder in SPEC_BUILDERS:
        node, module = definition_node(builder), builder.split(".")[0]
        fields = {}
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
            for keyword in call.keywords:
                named = named_definitions(keyword.value, module) - set(SPEC_BUILDERS)
                fields.setdefault(keyword.arg, set()).update(named)
        put.append(fields)
    plain, fast = put
    return {field: (plain.get(field, set()), fast.get(field, set()) - plain.get(field, set()))
            for field in plain}


def fast_forms():
    """What gpt.fast_spec puts in the spec in place of the plain forms: skipped."""
    return {q for _, fast in spec_fields().values() for q in fast}


def spec_definitions(node):
    """The definitions behind `spec.field` in `node` (any `...spec.field` or `layer_spec(...)
    .field`): the plain and the fast forms of that field."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr in spec_fields() \
                and re.search(r"\bspec$|_spec\(.*\)$", ast.unparse(n.value)):
            found |= set().union(*spec_fields()[n.attr])
    return found


@functools.lru_cache(maxsize=None)
def reached(qualified):
    """The project definitions a reader opens from `qualified`, one level: what it names and
    its spec fields hold (itself and its own class left out)."""
    node = definition_node(qualified)
    found = named_definitions(node, qualified.split(".")[0]) | spec_definitions(node)
    return {q for q in found if not (qualified + ".").startswith(q + ".")}


def skipped_by(qualified):
    """The rule that skips a definition on a first reading, or None."""
    folder = os.path.dirname(module_files()[qualified.split(".")[0]])
    if folder in SKIPPED_FOLDERS:
        return f"{folder}/"
    if qualified.split(".")[0] in DATA_PIPELINE:
        return "the data pipeline"
    return "the fast forms" if qualified in fast_forms() else None


def through_primitives(qualified, primitives):
    """What `qualified` reaches, a primitive it reaches opened in its place (transitively)."""
    seen, todo, found = set(), list(reached(qualified)), set()
    while todo:
        q = todo.pop()
        if q in seen:
            continue
        seen.add(q)
        if q in primitives and not skipped_by(q):
            todo += reached(q)
        else:
            found.add(q)
    return found


def follow(concepts, primitives):
    """Per concept: {"listed": lines of its listed definitions, "unlisted": {a definition it
    reaches that neither it nor an earlier concept lists, not a primitive, not skipped: lines},
    "later": {a definition it reaches that a later concept lists: lines}}, README's order."""
    order = [[q for q, _ in entries] for _, entries in concepts.values()]
    listed = {q for names in order for q in names}
    table, opened = {}, set()
    for i, (name, names) in enumerate(zip(concepts, order)):
        earlier = {q for names_ in order[:i + 1] for q in names_}
        row = {"listed": sum(lines(q) for q in names), "unlisted": {}, "later": {}}
        for q in sorted({r for q in names for r in through_primitives(q, primitives)}):
            if q in earlier or q in primitives or skipped_by(q):
                continue
            if q in listed:
                row["later"][q] = lines(q)
            elif q not in opened:
                row["unlisted"][q] = lines(q)
        opened |= set(row["unlisted"])
        table[name] = row
    return table


def placement(concepts, primitives):
    """{concept: [what to add to its list]}: each definition reached but listed nowhere goes to
    the first concept (README's order) that reaches it, with what it reaches in turn; what only
    the roots reach goes to "the roots"."""
    listed = {q for _, entries in concepts.values() for q, _ in entries}
    order = [(name, [q for q, _ in entries]) for name, (_, entries) in concepts.items()]
    added = {}
    for name, names in [*order, ("the roots", list(ROOTS))]:
        mine = [q for q in names if q not in listed]
        listed |= set(mine)
        todo = list(names)
        while todo:
            for q in sorted(through_primitives(todo.pop(0), primitives) - listed):
                if q not in primitives and not skipped_by(q):
                    listed.add(q)
                    mine.append(q)
                    todo.append(q)
        added[name] = mine
    return added


def report(concepts, primitives):
    """The table: per concept its budget, stated and listed lines, the lines a reader must open
    (listed + reached, not listed by it or an earlier concept), how far beyond; what it reaches
    that a later concept lists, and what no concept lists; then where to list the latter."""
    rows = ["| concept | budget | stated | listed | must open | beyond | reached, listed later "
            "| reached, listed nowhere |", "|---|---|---|---|---|---|---|---|"]
    for name, row in follow(concepts, primitives).items():
        must = row["listed"] + sum(row["unlisted"].values()) + sum(row["later"].values())
        unlisted = ", ".join(f"{q} ({n})" for q, n in row["unlisted"].items()) or "-"
        later = ", ".join(f"{q} ({n})" for q, n in row["later"].items()) or "-"
        rows.append(f"| {name} | {BUDGETS.get(name, '?')} | {concepts[name][0]} | "
                    f"{row['listed']} | {must} | {100 * (must / row['listed'] - 1):.0f}% | "
                    f"{later} | {unlisted} |")
    for name, names in placement(concepts, primitives).items():
        if names:
            rows.append(f"\nTo list under {name} ({sum(map(lines, names))} lines): "
                        + ", ".join(f"`{q}` ({lines(q)})" for q in names))
    return "\n".join(rows)


if __name__ == "__main__":
    print(report(*reading_order()))
