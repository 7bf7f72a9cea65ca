"""vision.py against transformers' glm5_next: the image processor (its PIL backend) and the vision tower."""
import random

import numpy as np
import pytest
import torch

import vision

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
from transformers.models.glm5_next import image_processing_pil_glm5_next as hf_image  # noqa: E402
from transformers.models.glm5_next import modeling_glm5_next as hf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TINY = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=48,
            projection_intermediate_size=40, swiglu_limit=1.0)
SCALE = 0.25  # transformers' init std for the tiny tower: rows of about unit size, a good share of the MLPs clamped
FULL = vision.VisionConfig.from_dict({"depth": 24, "hidden_size": 1024, "num_heads": 16, "intermediate_size": 4096,
                                      "out_hidden_size": 4096, "projection_intermediate_size": 10240})


def random_image(height: int, width: int, seed: int):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_canvas_is_transformers_smart_resize():
    rng = random.Random(0)
    sizes = [(1, 1), (28, 28), (27, 29), (448, 448), (10, 3000), (3000, 10), (4000, 3000), (2, 9000)]
    sizes += [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(300)]
    for budget in (8000, 64):
        cfg = vision.VisionConfig(**{**FULL.__dict__, "max_image_tokens": budget})
        for h, w in sizes:
            want = hf_image.smart_resize(2, h, w, temporal_factor=2, factor=28, min_pixels=16, max_pixels=budget)
            assert vision.canvas(h, w, cfg) == want, (h, w, budget)
            assert vision.image_tokens((want[0] // 14, want[1] // 14), cfg) <= budget


@pytest.mark.parametrize("height, width", [(56, 84), (37, 101), (300, 200), (1200, 700), (8, 8)])
def test_patches_are_the_image_processors(height, width):
    """Resize (bicubic, or none), black padding, CLIP normalization, block order, two frames: as transformers."""
    image = random_image(height, width, height * width)
    proc = hf_image.Glm5NextImageProcessorPil(max_image_tokens=500)
    want = proc(images=[image], return_tensors="pt")
    cfg = vision.VisionConfig(**{**FULL.__dict__, "max_image_tokens": 500})
    patches, grid = vision.image_patches(image, cfg)
    assert [1, *grid] == want["image_grid_thw"][0].tolist()
    assert patches.shape == want["pixel_values"].shape
    torch.testing.assert_close(patches, want["pixel_values"].float(), atol=2e-6, rtol=0)


def test_the_checkpoints_processor_settings_are_read():
    cfg = vision.VisionConfig.from_dict(TINY, {"max_image_tokens": 64, "image_mean": [0.5] * 3, "merge_size": 2,
                                               "size": {"longest_edge": 1}})
    assert (cfg.max_image_tokens, cfg.min_image_tokens, cfg.image_mean, cfg.image_std) == (64, 16, (0.5,) * 3,
                                                                                          vision.CLIP_STD)
    assert vision.image_patches(random_image(900, 900, 0), cfg)[1] == (16, 16)  # 64 tokens, not 8000's 4096
    with pytest.raises(ValueError, match="the image processor's merge_size 4 is not the tower's 2"):
        vision.VisionConfig.from_dict(TINY, {"merge_size": 4})


def hf_tower(seed: int) -> "hf.Glm5NextVisionModel":
    torch.manual_seed(seed)
    ref = hf.Glm5NextVisionModel(transformers.Glm5NextVisionConfig(**TINY, initializer_range=SCALE)).eval()
    with torch.no_grad():  # (norm weights start at 1 and biases at 0: spread them so that each is tested)
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return ref


def test_tower_matches_transformers():
    """Three images, two of one grid, in one transformers call (attention kept within each) against ours in one run
    (the two of a size in one attention call) and one at a time: the merged rows match in fp32."""
    ref = hf_tower(0)
    cfg = vision.VisionConfig.from_dict(TINY)
    tower = vision.VisionTower(cfg, {k: v.detach() for k, v in ref.state_dict().items()})
    images = [vision.image_patches(random_image(h, w, seed), cfg) for h, w, seed in ((60, 90, 1), (150, 40, 2),
                                                                                     (60, 90, 3))]
    grids = torch.tensor([[1, *g] for _, g in images])
    with torch.no_grad():
        want = ref(torch.cat([p for p, _ in images]), grid_thw=grids).pooler_output
    got = tower(images)
    assert [len(r) for r in got] == [vision.image_tokens(g, cfg) for _, g in images]
    assert 0.3 < want.abs().mean() < 3
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([tower([image])[0] for image in images]), want, atol=1e-5, rtol=1e-4)


def test_tower_names_what_it_misses():
    cfg = vision.VisionConfig.from_dict(TINY)
    weights = {k: v.detach() for k, v in hf_tower(0).state_dict().items()}
    del weights["blocks.1.attn.qkv.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.visual.blocks.1.attn.qkv.weight'\] \(1 of 39"):
        vision.VisionTower(cfg, weights)
    assert len(vision.expected_names(FULL)) == 347  # the published checkpoint's vision tensors


# ---------------------------------------------------------------------------------------------
# A prompt with images through the engine, against transformers' Glm5NextForConditionalGeneration

IMAGE = 500  # the oracle's image_token_id (its vocabulary is the test tokenizer's 512)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A perturbed tiny transformers model with a vision tower, saved, and our engine on the saved checkpoint."""
    import checkpoint
    import engine as E
    from model_glm import GLMConfig, GLMModel
    from test_engine import make_tokenizer
    from test_model import TEXT, perturb

    path = tmp_path_factory.mktemp("vlm")
    torch.manual_seed(5)
    cfg = transformers.Glm5NextConfig(text_config={**TEXT, "vocab_size": 512},
                                      vision_config={**TINY, "out_hidden_size": TEXT["hidden_size"],
                                                     "initializer_range": SCALE}, image_token_id=IMAGE)
    ref = transformers.Glm5NextForConditionalGeneration(cfg).eval()
    perturb(ref, torch.Generator().manual_seed(6))
    ref.save_pretrained(path)
    config = GLMConfig.from_file(path)
    model = GLMModel(config, checkpoint.load_weights(path, config, torch.float32, "cpu", progress=False))
    tower = vision.load(path, vision.stored(path), torch.float32, "cpu")
    assert tower is not None and tower.image_token_id == IMAGE
    tokenizer = make_tokenizer(512)
    tokenizer.save(str(path / "tokenizer.json"))
    eng = E.Engine(model, tokenizer, eos_token_ids=[1], num_blocks=64, block_size=16, max_num_seqs=4,
                   max_batch_tokens=64, vision_tower=tower)
    return ref, eng, path


def hf_greedy(ref, ids: list[int], images: list, n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ids (the images' placeholders written out) and its first logits."""
    proc = hf_image.Glm5NextImageProcessorPil()
    px = proc(images=images, return_tensors="pt")
    x = torch.tensor([ids])
    with torch.no_grad():
        first = ref(input_ids=x, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"]).logits[0, -1]
        out = ref.generate(input_ids=x, pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                           max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist(), first


def count_tower_runs(eng, monkeypatch) -> list:
    """The tower's runs from here on, each the grids of its images."""
    calls = []
    tower = eng.vision.__class__.__call__
    monkeypatch.setattr(eng.vision.__class__, "__call__",
                        lambda self, images: calls.append([g for _, g in images]) or tower(self, images))
    return calls


def test_an_image_prompt_matches_transformers(vlm, monkeypatch):
    """The engine writes the <|image|> token out to the image's 20 tokens, puts the tower's rows there (the image
    across two prefill chunks of at most 64 tokens, from one run of the tower), and greedy decoding continues as
    transformers' does."""
    import engine as E

    ref, eng, _ = vlm
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(2, 400, (55,), generator=g).tolist() + [IMAGE] + torch.randint(
        2, 400, (30,), generator=g).tolist()  # the image's rows 55..74 span the first chunk's end (64)
    image = random_image(60, 90, 1)
    calls = count_tower_runs(eng, monkeypatch)
    with pytest.raises(ValueError, match=r"has 1 <\|image\|> tokens for 2 images"):
        eng.add_request(prompt, images=[image, image])
    rid = eng.add_request(prompt, E.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                          images=[image])
    seq = eng.requests[rid]
    n = vision.image_tokens(vision.image_patches(image, eng.vision.cfg)[1], eng.vision.cfg)
    assert seq.token_ids == prompt[:55] + [IMAGE] * n + prompt[56:] and (seq.images[0].start, n) == (55, 20)
    outs = []
    while eng.has_work():
        outs += eng.step()
    assert len(calls) == 1 and eng.image_rows == {}
    got = [t for o in outs for t in o.token_ids]
    want, first = hf_greedy(ref, seq.prompt_tensor.tolist(), [image], 6)
    assert got == want
    lp = torch.log_softmax(first, -1)
    top = outs[0].logprobs[0].top
    assert [i for i, _ in top] == lp.topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in top]), lp.topk(3).values, atol=1e-4, rtol=0)


def test_two_images_in_one_prompt_match_transformers(vlm, monkeypatch):
    """A prompt with two images of different sizes: one run of the tower reads both, and greedy decoding continues
    as transformers' does."""
    import engine as E

    ref, eng, _ = vlm
    g = torch.Generator().manual_seed(10)
    words = lambda n: torch.randint(2, 400, (n,), generator=g).tolist()
    prompt = words(5) + [IMAGE] + words(3) + [IMAGE] + words(4)
    images = [random_image(60, 90, 11), random_image(150, 40, 12)]
    calls = count_tower_runs(eng, monkeypatch)
    rid = eng.add_request(prompt, E.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), images=images)
    ids = eng.requests[rid].prompt_tensor.tolist()
    outs = []
    while eng.has_work():
        outs += eng.step()
    assert calls == [[vision.image_patches(im, eng.vision.cfg)[1] for im in images]]
    assert [t for o in outs for t in o.token_ids] == hf_greedy(ref, ids, images, 4)[0]


def test_a_preempted_image_prompt_runs_the_tower_again_and_answers_the_same(vlm, monkeypatch):
    """A pool too small for four image prompts and their answers preempts one as it decodes, its image's rows
    dropped: it runs the tower again and all answer as each does alone."""
    import engine as E

    _, eng, _ = vlm
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(2, 400, (n,), generator=g).tolist() + [IMAGE, 7, 8, 9] for n in (5, 8, 3, 6)]
    images = [[random_image(60, 90, 20 + i)] for i in range(4)]
    greedy = E.SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    alone = []
    for ids, im in zip(prompts, images):
        rid = eng.add_request(ids, greedy, images=im)
        outs = []
        while eng.has_work():
            outs += eng.step()
        alone.append([t for o in outs if o.request_id == rid for t in o.token_ids])
    small = E.Engine(eng.model, eng.tokenizer, eos_token_ids=[1], num_blocks=10, block_size=16, max_num_seqs=4,
                     max_batch_tokens=64, snapshot_bytes=0, vision_tower=eng.vision)  # 160 tokens for 170
    calls = count_tower_runs(small, monkeypatch)
    rids = [small.add_request(ids, greedy, images=im) for ids, im in zip(prompts, images)]
    outs = []
    while small.has_work():
        outs += small.step()
    assert small.stats().preemptions > 0 and sum(map(len, calls)) > 4 and small.image_rows == {}
    assert [[t for o in outs if o.request_id == rid for t in o.token_ids] for rid in rids] == alone


def test_an_image_prompt_with_the_mtp_speculator_answers_as_without(monkeypatch):
    """With a speculator the prompt's chunks run through the target pass of dflash.py, which carries the image's
    rows too: greedy tokens with speculator="mtp" equal the plain engine's. The MTP layer reads the same rows at
    the image's positions (its input at t is token t+1's: each row one earlier), not the <|image|> embedding."""
    import dflash
    import engine as E
    import tiny
    from model_glm import GLMConfig, GLMModel
    from test_engine import make_tokenizer

    trunk, mtp = {}, {}  # position -> the image row the trunk's / the MTP layer's chunks carry there

    def recording(fn, seen: dict, shift: int):  # fn(model or hidden, batch, ...)
        def run(*args, **kwargs):
            for c in args[1]:
                seen.update({c.start + shift + r + j: rows[j] for r, rows in c.images for j in range(len(rows))})
            return fn(*args, **kwargs)
        return run

    cfg = GLMConfig.from_dict(tiny.tiny_config_dict())
    model, tok = GLMModel(cfg, tiny.random_weights(cfg)), make_tokenizer(cfg.vocab_size)
    tower = tiny.random_vision_tower(cfg.hidden_size, 300)
    prompt = list(range(5, 30)) + [300] + list(range(40, 50))
    got = {}
    for spec in ("none", "mtp"):
        eng = E.Engine(model, tok, eos_token_ids=[1], num_blocks=64, block_size=16, max_batch_tokens=64,
                       speculator=spec, vision_tower=tower, draft_tokens=3 if spec == "mtp" else None)
        if spec == "mtp":  # (chunk positions are t's; the MTP chunk's tokens are t+1's)
            monkeypatch.setattr(dflash, "target_forward", recording(dflash.target_forward, trunk, 0))
            monkeypatch.setattr(model, "mtp_forward", recording(model.mtp_forward, mtp, 1))
        eng.add_request(prompt, E.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        images=[random_image(60, 90, 30)])
        outs = []
        while eng.has_work():
            outs += eng.step()
        got[spec] = [t for o in outs for t in o.token_ids]
        assert spec == "none" or eng.stats().spec_draft_tokens > 0
    assert got["mtp"] == got["none"]
    assert len(trunk) > 16 and mtp.keys() == trunk.keys() and all(torch.equal(mtp[p], trunk[p]) for p in trunk)


def test_tower_runs_hold_one_largest_image():
    cfg = vision.VisionConfig.from_dict(TINY, {"max_image_tokens": 16})  # runs of 64 patches at most
    sizes = [16, 40, 8, 64, 4]
    images = [vision.Prepared(torch.zeros(n, 1), (n, 1), n // 4, bytes([n])) for n in sizes]
    assert [[im.num_patches for im in run] for run in vision.runs(images, cfg)] == [[16, 40, 8], [64], [4]]


def test_the_prefix_cache_tells_images_apart(vlm, monkeypatch):
    """Live requests with one image share the tower's run; the prefix cache hits an image it has seen (and runs no
    tower for it) and not another one."""
    import engine as E

    _, eng, _ = vlm
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(2, 400, (40,), generator=g).tolist() + [IMAGE] + torch.randint(
        2, 400, (20,), generator=g).tolist()
    greedy = E.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(image) -> tuple[list[int], int]:
        before = eng.stats().prefix_hit_tokens
        rid = eng.add_request(prompt, greedy, images=[image])
        outs = []
        while eng.has_work():
            outs += eng.step()
        return [t for o in outs if o.request_id == rid for t in o.token_ids], eng.stats().prefix_hit_tokens - before

    calls = count_tower_runs(eng, monkeypatch)
    short = prompt[:30] + [IMAGE, 5, 6]  # the image ends in the prompt's last block, which is not full: no hit past it
    for _ in range(3):  # one token each: the last request ends with its prefill, and no later step drops the rows
        eng.add_request(short, E.SamplingParams(max_tokens=1), images=[random_image(60, 90, 2)])
    while eng.has_work():
        eng.step()
    assert len(calls) == 1 and eng.image_rows == {}
    a, _ = run(random_image(60, 90, 2))
    b, _ = run(random_image(60, 90, 3))  # (snapshots the branch point, the block the image starts in)
    c, hit_c = run(random_image(60, 90, 4))
    assert len(calls) == 4
    a2, hit_a = run(random_image(60, 90, 2))
    assert a2 == a and len({tuple(a), tuple(b), tuple(c)}) == 3
    assert (hit_c, hit_a) == (32, 64)  # c: the two blocks before its image; a again: past the image too
    assert len(calls) == 4  # so no tower for it


def test_load_reads_the_tower_and_plans_for_it(vlm):
    """engine.load loads the tower beside the embedding; the placement plan counts it (a device budget that
    holds the text model but not the tower too is refused before any weight is read)."""
    import engine as E
    import placement

    _, eng, path = vlm
    tower_bytes = vision.weight_bytes(vision.stored(path), torch.float32)
    assert tower_bytes == sum(t.numel() * 4 for t in eng.vision.w.values())
    opts = dict(device="cpu", dtype=torch.float32, num_blocks=64, block_size=16, max_num_seqs=4, max_batch_tokens=64,
                progress=False)
    budget = 1 << 34
    loaded = E.load(path, memory_per_device=budget, **opts)
    assert loaded.vision is not None and loaded.vision.image_token_id == IMAGE
    plan = loaded.model.placement
    assert plan.budget[0] == budget - tower_bytes
    need = plan.weight_bytes[0] + plan.cache_bytes[0]  # the text model's weights and the cache planned for
    assert E.load(path, memory_per_device=need + tower_bytes, **opts).vision is not None
    with pytest.raises(placement.PlacementError):
        E.load(path, memory_per_device=need + tower_bytes // 2, **opts)


def test_generate_reads_the_images_of_chat_messages():
    """engine.generate and stream with {"type": "image", "image": ...} parts (PIL images, bytes or URLs): the
    template's placeholder is written out to the image's tokens; without a tower the request is refused."""
    import io

    import engine as E
    import tiny

    eng = E.load(None, device="cpu", progress=False)
    assert eng.vision is None  # the built-in model has no tower
    image = random_image(60, 90, 5)
    png = io.BytesIO()
    image.save(png, format="PNG")
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image", "image": png.getvalue()}]}]
    with pytest.raises(ValueError, match="has no vision tower"):
        eng.generate([messages], E.SamplingParams(max_tokens=2))
    eng.vision = tiny.random_vision_tower(eng.config.hidden_size, eng.tokenizer.token_to_id("<|image|>"))
    greedy = E.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    got = eng.generate([messages], greedy)[0]
    text_only = eng.generate([[{"role": "user", "content": "What is this?"}]], greedy)[0]
    placeholder = len(eng.tokenizer.encode("<|begin_of_image|><|image|><|end_of_image|>",
                                           add_special_tokens=False).ids)
    n = vision.prepare(image, eng.vision.cfg).tokens
    assert got.usage.prompt_tokens == text_only.usage.prompt_tokens + placeholder - 1 + n
    streamed = list(eng.stream(messages, greedy))
    assert [t for o in streamed for t in o.token_ids] == got.token_ids


def test_open_image_reads_data_urls_http_urls_and_bytes(monkeypatch):
    import base64
    import http.server
    import io
    import threading

    image = random_image(20, 30, 7)
    out = io.BytesIO()
    image.save(out, format="PNG")
    png = out.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/cat.png"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(png if ok else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        for source in (png, "data:image/png;base64," + base64.b64encode(png).decode(), url + "/cat.png", image):
            assert np.array_equal(np.asarray(vision.open_image(source).convert("RGB")), np.asarray(image)), source
        with pytest.raises(ValueError, match="could not be fetched: HTTP Error 404"):
            vision.open_image(url + "/dog.png")
    finally:
        server.shutdown()
    for bad, words in ((b"not an image", "could not be decoded"), ("data:image/png,abc", "must be data:<type>;base64"),
                       ("data:image/png;base64,@@", "base64 is not valid"), ("/etc/passwd", "an image is a data URL"),
                       (5, "an image is a data URL")):
        with pytest.raises(ValueError, match=words):
            vision.open_image(bad)
    monkeypatch.setattr(vision, "MAX_IMAGE_BYTES", len(png) - 1)
    with pytest.raises(ValueError, match=f"the image has {len(png)} bytes, more than {len(png) - 1}"):
        vision.open_image(png)
