"""Qwen2-VL-family models built in code: the ``tiny-random`` smoke-test model and the full-size
architectures the benchmark times with random weights (nothing is downloaded).

The tokenizer is byte-level BPE, so any text round-trips exactly, plus the Qwen special tokens:
without merges (every UTF-8 byte a token, ~270 entries) for the tiny model, or with merges learnt
in code from a list of common English words (``build_tokenizer("english")``), so prompts cost
about as many tokens as with Qwen2's real 151k vocabulary (the chat template around a video: 15
tokens before it, and "What is the person on the left doing with the red object?" + the tail: 19;
the byte-level one makes that 45 + 71). The full-size benchmarks use that one: text tokens are
part of every prefill they time.
"""
from __future__ import annotations

from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                          Qwen2VLConfig, Qwen2VLForConditionalGeneration)

from pipeline.vlm import hf, qwen3_vl

Family = Literal["qwen2_vl", "qwen2_5_vl"]
FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl")
MODEL_CLASSES = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
TINY_SEED = 1234


# Common English words (and the chat template's, and those of the generated video QA of
# evaluation/synth_qa.py: its colours, shapes, regions): merges are learnt so that each is one token,
# with and without a leading space and capitalized, as in GPT-style BPE vocabularies.
ENGLISH_WORDS = """the of and to a in is it you that he was for on are with as I his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how said an each she which
do their time if will way about many then them write would like so these her long make thing see him two has look
more day could go come did number sound no most people my over know water than call first who may down side been
now find any new work part take get place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say help low line differ turn cause much
mean before move right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father head stand own page should
country found answer school grow study still learn plant cover food sun four between state keep eye never last
let thought city tree cross farm hard start might story saw far sea draw left late run while press close night
real life few north open seem together next white children begin got walk example ease paper group always music
those both mark often letter until mile river car feet care second book carry took science eat room friend began
idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual young
ready above ever red list though feel talk bird soon body dog family direct pose leave song measure door product
black short numeral class wind question happen complete ship area half rock order fire south problem piece told
knew pass since top whole king space heard best hour better true during hundred five remember step early hold
west ground interest reach fast verb sing listen six table travel less morning ten simple several vowel toward
war lay against pattern slow center love person money serve appear road map rain rule govern pull cold notice
voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean warm
free minute strong special mind behind clear tail produce fact street inch multiply nothing course stay wheel
full force blue object decide surface deep moon island foot system busy test record boat common gold possible
plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring yes
distant fill east paint language among helpful assistant user video doing playing woman cooking talking singing
dancing running driving shows showing describe happening happens yellow purple orange cyan square circle
triangle bottom middle moving objects""".split()


def build_tokenizer(vocabulary: Literal["bytes", "english"] = "bytes") -> PreTrainedTokenizerFast:
    """Byte-level BPE over the 256 byte symbols + Qwen's special tokens; "english" adds merges
    (learnt here, deterministically, in ~30 ms) that make each of ENGLISH_WORDS one token."""
    if vocabulary not in ("bytes", "english"):
        raise ValueError(f"Invalid vocabulary ({vocabulary!r}). Supported values are bytes, english.")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocabulary == "bytes":
        core = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:
        core = Tokenizer(models.BPE())
        # the GPT-2 split (words with their leading space, digits, punctuation), as Qwen2's
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        corpus = [form for w in ENGLISH_WORDS for form in (w, " " + w, w.capitalize(), " " + w.capitalize())]
        trainer = trainers.BpeTrainer(vocab_size=65536, min_frequency=1, initial_alphabet=alphabet,
                                      show_progress=False)
        core.train_from_iterator(corpus + ["system\n", "user\n", "assistant\n"], trainer=trainer)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in
                                                          ("<|im_end|>", "<|endoftext|>")]})
    return tok


# Qwen2-VL-Instruct's chat template (one system turn by default; images and videos as pad tokens
# between vision markers), saved with built-in tokenizers so a snapshot renders prompts as
# VLM.prompt_ids builds them.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _token_ids(tok: PreTrainedTokenizerFast) -> dict:
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])


def _text_config(vocab_size: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
                 mrope_section: list[int], ids: dict, tie: bool, rope_theta: float = 1e6) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=tie,
                rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "mrope_section": mrope_section},
                bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])


def _config(family: Family, text: dict, vision: dict, ids: dict):
    top = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    cls = Qwen2VLConfig if family == "qwen2_vl" else Qwen2_5_VLConfig
    cfg = cls(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"], **top)
    hf.set_attention_implementation(cfg, "sdpa")
    return cfg


def tiny_config(family: Family, tokenizer: PreTrainedTokenizerFast):
    """Hidden 64, 2 LM layers, 2 vision blocks: fast on CPU, same code paths as the real models."""
    ids = _token_ids(tokenizer)
    text = _text_config(len(tokenizer), 64, 128, 2, 4, 2, [2, 3, 3], ids, tie=False)  # head_dim 16 -> 8 rope pairs
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
    else:
        # window_size 56 px = 2x2 merged cells, so the tiny frames exercise Qwen2.5's window attention
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1], tokens_per_second=2)
    return _config(family, text, vision, ids)


ARCHS = ("qwen2-vl-2b", "qwen2.5-vl-7b")


def arch_config(arch: str, tokenizer: PreTrainedTokenizerFast):
    """Full-size architectures (published config.json values) with the built-in tokenizer's special ids.
    The vocabulary keeps the real size so the LM head costs what it costs in the real model."""
    ids = _token_ids(tokenizer)
    if arch == "qwen2-vl-2b":
        text = _text_config(151936, 1536, 8960, 28, 12, 2, [16, 24, 24], ids, tie=True)
        vision = dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return _config("qwen2_vl", text, vision, ids)
    if arch == "qwen2.5-vl-7b":
        text = _text_config(152064, 3584, 18944, 28, 28, 4, [16, 24, 24], ids, tie=False)
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
        return _config("qwen2_5_vl", text, vision, ids)
    raise ValueError(f"Invalid architecture ({arch!r}). Supported values are {', '.join(ARCHS)}.")


def small_config(tokenizer: PreTrainedTokenizerFast, *, hidden: int, intermediate: int, layers: int, heads: int,
                 kv_heads: int, vision_depth: int, vision_dim: int, vision_heads: int, vision_mlp_ratio: int,
                 rope_theta: float = 1e6):
    """A small Qwen2-VL (the standard 14 px patches, 2x2 merge, frame pairs) with the built-in
    tokenizer's ids and tied embeddings: the shape of the models trained from scratch here
    (pipeline.training.qa_vlm). The LM's rotary pairs are split over (t, h, w) as Qwen2-VL's
    [16, 24, 24] of 64 are. The w section holds the slowest pairs: at Qwen2-VL's theta of 1e6 they
    turn by under 2e-4 rad per cell, so a model trained from scratch on small grids cannot tell left
    from right by position; a small `rope_theta` makes every section turn."""
    head_dim = hidden // heads
    if hidden % heads or head_dim % 8 or heads % kv_heads or vision_dim % vision_heads:
        raise ValueError(f"Invalid head layout: hidden {hidden} / {heads} heads ({kv_heads} KV heads), vision "
                         f"{vision_dim} / {vision_heads} heads: the widths must divide evenly and the LM's head "
                         f"size be a multiple of 8")
    pairs = head_dim // 2
    t = pairs // 4
    section = [t, (pairs - t) // 2, pairs - t - (pairs - t) // 2]
    ids = _token_ids(tokenizer)
    text = _text_config(len(tokenizer), hidden, intermediate, layers, heads, kv_heads, section, ids, tie=True,
                        rope_theta=rope_theta)
    vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden, num_heads=vision_heads,
                  mlp_ratio=vision_mlp_ratio, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return _config("qwen2_vl", text, vision, ids)


def model_class(family: str) -> type:
    """The transformers class of a family: Qwen2-VL, Qwen2.5-VL, or Qwen3-VL (dense, MoE)."""
    return qwen3_vl.model_class(family) if family in qwen3_vl.FAMILIES else MODEL_CLASSES[family]


def build_model(config, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = TINY_SEED):
    """Random-weight model built directly in ``dtype`` on ``device`` (no fp32 staging copy, so a 7B
    model in bf16 on a GPU allocates ~15 GB once)."""
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = model_class(config.model_type)(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
