"""Quantization recipes: readable TOML data that says how a Clover GGUF differs from llama.cpp's own mixtures.

A recipe (quant_recipes/<name>.toml) names a llama.cpp file type (its base mixture), the types of `output.weight`
and `token_embd.weight`, and an ordered list of tensor-name rules `{pattern, type}`. The rules become llama.cpp
tensor-type overrides (llama_model_quantize_params.tt_overrides): the first rule whose regex is found in a
tensor's name decides that tensor's type; tensors no rule matches follow llama.cpp's default logic for the ftype.

    ftype = "Q4_K_M"            # LLAMA_FTYPE_MOSTLY_Q4_K_M
    output = "Q6_K"             # a GGML type name
    token_embd = "Q4_K"

    [[rules]]
    pattern = '\\.ssm_(alpha|beta)\\.weight$'
    type = "F32"
    why = "..."
    optional = false             # true: matching no tensor is fine (e.g. the Clover extras in a plain-Qwen file)

Types are GGML type names as the gguf package spells them (GGMLQuantizationType); ftypes are the suffixes of the
binding's LLAMA_FTYPE_MOSTLY_* constants.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from clover_gguf.errors import UserError

# llama.cpp file types (LLAMA_FTYPE_MOSTLY_<NAME>) and their values in llama.h; the binding's constants are checked
# against these when it is loaded (clover_gguf.quantize), so a drift in the pinned library shows up at once.
FTYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11,
    "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18,
    "IQ2_XXS": 19, "IQ2_XS": 20, "Q2_K_S": 21, "IQ3_XS": 22, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25,
    "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32,
}
# ftypes that cannot be made without an importance matrix (llama.cpp refuses them)
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ1_S", "IQ1_M", "Q2_K_S"}
# the recipe files shipped with clover-gguf, by --type
BUILTIN = ("Q4_0", "Q4_K_M", "Q8_0", "Q3_K_S", "Q3_K_M", "IQ4_XS", "Q6_K")

# The rules every recipe carries (also the generated recipe for a --type without a file): see quant_recipes/*.toml
COMMON_RULES: tuple[tuple[str, str, bool, str], ...] = (
    (r"\.ssm_(alpha|beta)\.weight$", "F32", False,
     "GDN decay / write-strength projections: tiny, and their error compounds through the recurrent state"),
    (r"\.ffn_gate_inp(_shexp)?\.weight$", "F32", False, "expert router and shared-expert gate"),
    (r"\.(ssm_conv1d\.weight|ssm_a|ssm_dt\.bias|ssm_norm\.weight)$", "F32", False, "small GDN tensors"),
    (r"\.(ssm_conv1d_right\.weight|ssm_block_scale|ssm_block_history_bias|ssm_block_history_c)$", "F32", True,
     "Clover block-mode extras: never quantized"),
)


def ggml_type(name: str, where: str) -> QT:
    try:
        return QT[name.upper()]
    except KeyError:
        known = ", ".join(t.name for t in QT)
        raise UserError(f"{where}: unknown tensor type {name!r} (known: {known})") from None


def ftype_name(name: str, where: str = "--type") -> str:
    key = name.upper()
    if key not in FTYPES:
        raise UserError(f"{where}: unknown quantization type {name!r} (known: {', '.join(FTYPES)})")
    return key


@dataclass(frozen=True)
class Rule:
    pattern: str
    type: QT
    optional: bool = False
    why: str = ""

    @property
    def regex(self) -> re.Pattern:
        return re.compile(self.pattern)


@dataclass(frozen=True)
class Recipe:
    name: str
    ftype: str  # key of FTYPES
    output: QT | None  # None: llama.cpp's default for the ftype
    token_embd: QT | None
    rules: tuple[Rule, ...] = ()
    source: str = "<generated>"  # the file it came from
    sha256: str = ""
    description: str = ""
    extra: dict = field(default_factory=dict)

    def overrides(self, tensor_names: list[str]) -> list[tuple[str, QT]]:
        """(regex, type) in the order llama.cpp must try them: output and token_embd first, then the rules.

        With tied embeddings (no output.weight) llama.cpp gives token_embd the output's type; so do we."""
        out: list[tuple[str, QT]] = []
        has_output = "output.weight" in tensor_names
        if self.output is not None and has_output:
            out.append((r"^output\.weight$", self.output))
        embd = self.token_embd if has_output else (self.output or self.token_embd)
        if embd is not None:
            out.append((r"^token_embd\.weight$", embd))
        out += [(r.pattern, r.type) for r in self.rules]
        return out

    def stamp(self) -> str:
        """The value of the clover_moe.quant.recipe key (at most 127 bytes)."""
        s = f"{self.name} ftype={self.ftype}"
        if self.sha256:
            s += f" sha256={self.sha256[:16]}"
        return s[:127]


def recipes_dir() -> Path:
    """quant_recipes/ of the repository, or the copy installed with the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "quant_recipes", here / "quant_recipes"):
        if candidate.is_dir():
            return candidate
    raise UserError(f"cannot find the quant_recipes folder (looked in {here.parent / 'quant_recipes'})")


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such recipe file: {path}")
    raw = path.read_bytes()
    try:
        d = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None
    return recipe_from_dict(d, str(path), hashlib.sha256(raw).hexdigest(), default_name=path.stem)


def recipe_from_dict(d: dict, source: str, sha256: str = "", default_name: str = "recipe") -> Recipe:
    known = {"name", "ftype", "output", "token_embd", "rules", "description"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise UserError(f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if "ftype" not in d:
        raise UserError(f"{source}: missing `ftype` (the llama.cpp base mixture, e.g. \"Q4_K_M\")")
    ftype = ftype_name(str(d["ftype"]), f"{source}: ftype")
    output = ggml_type(str(d["output"]), f"{source}: output") if d.get("output") not in (None, "default") else None
    embd = ggml_type(str(d["token_embd"]), f"{source}: token_embd") if d.get("token_embd") not in (None, "default") \
        else None
    rules = []
    raw_rules = d.get("rules", [])
    if not isinstance(raw_rules, list):
        raise UserError(f"{source}: `rules` must be an array of tables ([[rules]])")
    for k, r in enumerate(raw_rules, start=1):
        where = f"{source}: rule {k}"
        if not isinstance(r, dict) or "pattern" not in r or "type" not in r:
            raise UserError(f"{where}: needs `pattern` and `type`")
        extra = sorted(set(r) - {"pattern", "type", "optional", "why"})
        if extra:
            raise UserError(f"{where}: unknown key(s) {', '.join(extra)}")
        try:
            re.compile(r["pattern"])
        except re.error as e:
            raise UserError(f"{where}: bad regex {r['pattern']!r} ({e})") from None
        rules.append(Rule(str(r["pattern"]), ggml_type(str(r["type"]), where), bool(r.get("optional", False)),
                          str(r.get("why", ""))))
    return Recipe(str(d.get("name", default_name)), ftype, output, embd, tuple(rules), source, sha256,
                  str(d.get("description", "")))


def default_recipe(ftype: str) -> Recipe:
    """For a --type without a recipe file: llama.cpp's mixture plus the Clover rules every recipe carries."""
    rules = tuple(Rule(p, QT[t], opt, why) for p, t, opt, why in COMMON_RULES)
    return Recipe(f"{ftype.lower()}-default", ftype, None, None, rules, "<generated>", "",
                  "llama.cpp's mixture with the Clover invariants")


def recipe_for(type_name: str, recipe_file: Path | None = None) -> Recipe:
    """The recipe for --type (and --recipe FILE when given; its ftype must agree with --type)."""
    ftype = ftype_name(type_name)
    if recipe_file is not None:
        r = load_recipe(recipe_file)
        if r.ftype != ftype:
            raise UserError(f"{recipe_file}: recipe is for {r.ftype}, not --type {ftype}")
        return r
    path = recipes_dir() / f"{ftype.lower()}.toml"
    return load_recipe(path) if path.is_file() else default_recipe(ftype)


def check_rules(recipe: Recipe, tensor_names: list[str]) -> dict[str, list[str]]:
    """pattern -> the tensors whose type it decides (first match wins, as in llama.cpp); a non-optional rule that
    decides no tensor (it matches nothing, or only tensors an earlier rule took) is an error."""
    claimed: set[str] = set()
    for pattern, _ in recipe.overrides(tensor_names)[:-len(recipe.rules) or None]:  # output, token_embd
        claimed |= {n for n in tensor_names if re.search(pattern, n)}
    decided: dict[str, list[str]] = {}
    for r in recipe.rules:
        rx = r.regex
        hits = [n for n in tensor_names if n not in claimed and rx.search(n)]
        if not hits and not r.optional:
            raise UserError(f"{recipe.source}: rule {r.pattern!r} -> {r.type.name} matches no tensor of the model")
        claimed.update(hits)
        decided[r.pattern] = hits
    return decided
