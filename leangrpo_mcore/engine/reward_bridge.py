"""The reward bridge: the step engine's ``reward_fn`` in a training run (decode, score, keep sample images)."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from leangrpo_mcore.config import Config
from leangrpo_mcore.data.vae import PACKED_FAMILIES, DecodedImages
from leangrpo_mcore.engine import build
from leangrpo_mcore.engine.control.watchdog import StepWatchdog
from leangrpo_mcore.engine.evaluate import reward_input
from leangrpo_mcore.engine.output.samples import to_uint8, video_to_uint8
from leangrpo_mcore.engine.output.video import require_video_extra
from leangrpo_mcore.rl.rewards import RewardError
from leangrpo_mcore.rl.rewards.base import flatten_videos


class RewardBridge:
    """The step engine's ``reward_fn``: decode latents, score them, keep sample images, capture reward errors.

    The reward sees the decoded images, or a video policy's videos, of which it scores the frames that
    ``reward.options.frames`` names (the first by default), and a reward that declares ``reference_images`` each
    sample's conditioning image (``data.images``). A captured sample keeps its image as uint8, for a video policy
    (``sampler.frames > 1``) its whole video as uint8 too, and its conditioning image as uint8.

    :meth:`submit` does the same in the background (``reward.async_scoring``): one worker thread decodes the
    batches in submission order and hands each to the reward's ``submit``, so that a remote reward's requests
    are in flight while the next batch decodes. Errors and sample images are kept in submission order, so a
    step reports what a synchronous one would.

    With ``reward.aggregate: advantages`` it returns the (B, K) component rewards of the weighted reward (scored on
    the decoding thread in the background) and captions the samples with their weighted sum.
    """

    def __init__(self, data: build.DataParts, config: Config) -> None:
        self.data = data
        self.family = config.model.family
        self.height, self.width = config.sampler.height, config.sampler.width
        self.keep_video = config.sampler.frames > 1
        if self.keep_video:
            require_video_extra()  # on every rank before training, not on rank 0 at the first sample step
        # build._reward allows aggregate=advantages only with the weighted reward, wrapped in a ValidatedReward
        self.weighted = data.reward.fn if config.reward.aggregate == "advantages" and data.reward is not None else None
        self.error: Optional[str] = None
        self.capture = False
        self.watchdog: Optional[StepWatchdog] = None
        self._lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None
        self.begin_step(False)

    def begin_step(self, capture: bool, sources: Optional[dict[int, torch.Tensor]] = None) -> None:
        """Reset the per-step state; ``capture`` keeps this step's images for a sample grid; ``sources`` maps the
        prompt id of each sample this rank scores to its conditioning image (3, H, W) in [0, 1] (``data.images``)."""
        with self._lock:
            self.error, self.capture = None, capture
            self._error_at: Optional[int] = None
            self._samples: dict[int, list] = {}
            self._calls = 0
            self._sources = sources

    @property
    def samples(self) -> list[tuple]:
        """(image, prompt, reward, prompt id, video, source) of this step's captured generations, in call order:
        the image (H, W, 3) uint8, the video (F, H, W, 3) uint8 or None (image policies), the conditioning image
        (H, W, 3) uint8 or None."""
        with self._lock:
            return [item for index in sorted(self._samples) for item in self._samples[index]]

    def _next_call(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls

    def _failed(self, index: int, message: str) -> None:
        """Keep the error of the earliest failing call (the one a synchronous step would stop at)."""
        with self._lock:
            if self._error_at is None or index < self._error_at:
                self.error, self._error_at = message, index

    def _decode(self, final_latents: torch.Tensor) -> DecodedImages:
        size = {"height": self.height, "width": self.width} if self.family in PACKED_FAMILIES else {}
        return self.data.decoder.decode(final_latents, **size)

    def _references(self, ids: list[int]) -> Optional[torch.Tensor]:
        """(B, 3, H, W) conditioning images of the samples of prompts ``ids``, or None without them."""
        return None if self._sources is None else torch.stack([self._sources[i] for i in ids])

    def _keep(self, index: int, decoded: DecodedImages, prompts: list, rewards: torch.Tensor,
              prompt_ids: torch.Tensor, references: Optional[torch.Tensor]) -> None:
        if self.capture:
            videos = ([None] * len(prompts) if not self.keep_video or decoded.video is None
                      else list(video_to_uint8(decoded.video)))
            sources = [None] * len(prompts) if references is None else list(to_uint8(references))
            items = list(zip(to_uint8(decoded.images), prompts, rewards.tolist(), prompt_ids.tolist(), videos,
                             sources))
            with self._lock:
                self._samples[index] = items

    def _zeros(self, batch: int) -> torch.Tensor:
        """What a failed batch returns: zeros shaped as its rewards."""
        return torch.zeros(batch, len(self.weighted.weights)) if self.weighted is not None else torch.zeros(batch)

    def _components(self, images: torch.Tensor, prompts: list, metadata: list,
                    references: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted reward's (B, K) components and their weighted sum (B,); videos are scored on the frames that
        ``reward.options.frames`` names, averaged per video, as the reward's own call scores them."""
        flat, flat_prompts, k = flatten_videos(images, prompts, self.data.reward.frames)
        if references is not None and k > 1:
            references = references.repeat_interleave(k, dim=0)
        components, total = self.weighted.scored_components(flat, flat_prompts,
                                                            [row for row in metadata for _ in range(k)], references)
        batch = images.shape[0]
        return components.view(batch, k, -1).mean(dim=1), total.view(batch, k).mean(dim=1)

    def _split(self, scored) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards for the engine, rewards for the captions) of a scoring result."""
        return scored if self.weighted is not None else (scored, scored)

    def __call__(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
        """(B,) rewards ((B, K) component rewards) of ``final_latents``; zeros after a reward error (the step is
        then abandoned). The step watchdog sees the call as the phase "reward"."""
        if self.watchdog is None:
            return self._score(final_latents, prompt_ids)
        self.watchdog.enter("reward")
        try:
            return self._score(final_latents, prompt_ids)
        finally:
            self.watchdog.enter("rollout and update")

    def _score(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
        ids = [int(i) for i in prompt_ids.tolist()]
        prompts, metadata = self.data.dataset.get(ids), self.data.dataset.metadata(ids)
        index = self._next_call()
        if self.error is not None:
            return self._zeros(len(prompts))
        decoded = self._decode(final_latents)
        images, references = reward_input(decoded), self._references(ids)
        try:
            rewards, shown = self._split(self._components(images, prompts, metadata, references)
                                         if self.weighted is not None
                                         else self.data.reward(images, prompts, metadata, references))
        except RewardError as err:
            self._failed(index, str(err))
            return self._zeros(len(prompts))
        self._keep(index, decoded, prompts, shown, prompt_ids, references)
        return rewards

    def submit(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> "Future[torch.Tensor]":
        """A Future of what calling the bridge returns; decoding and scoring run in the background.

        ``final_latents`` must not change until the Future is done. A reward error resolves the Future to
        zeros and sets :attr:`error` (as a call does); any other failure is the Future's exception.
        """
        ids = [int(i) for i in prompt_ids.tolist()]
        prompts, metadata = self.data.dataset.get(ids), self.data.dataset.metadata(ids)
        references = self._references(ids)
        index = self._next_call()
        outer: Future = Future()
        if self.error is not None:
            outer.set_result(self._zeros(len(prompts)))
            return outer
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward-decode")
            executor = self._executor
        stream = torch.cuda.current_stream(final_latents.device) if final_latents.is_cuda else None

        def settle(decoded: Optional[DecodedImages], done: Future) -> None:
            try:
                rewards, shown = self._split(done.result())
            except RewardError as err:
                self._failed(index, str(err))
                outer.set_result(self._zeros(len(prompts)))
                return
            except BaseException as exc:  # noqa: BLE001 -- the engine re-raises it where it joins the Future
                outer.set_exception(exc)
                return
            try:
                self._keep(index, decoded, prompts, shown, prompt_ids, references)
            except BaseException as exc:  # noqa: BLE001
                outer.set_exception(exc)
                return
            outer.set_result(rewards)

        def decode_and_score() -> None:
            try:
                # The worker decodes on the caller's device and stream, after the rollout that made the latents.
                device = contextlib.nullcontext() if stream is None else torch.cuda.device(final_latents.device)
                with device, (contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)):
                    decoded = self._decode(final_latents)
                    images = reward_input(decoded)
                    submit = None if self.weighted is not None else getattr(self.data.reward, "submit", None)
                    if callable(submit):
                        scoring = submit(images, prompts, metadata, references)
                    elif self.weighted is not None:  # the components, each validated, scored here
                        scoring = Future()
                        scoring.set_result(self._components(images, prompts, metadata, references))
                    else:  # a bare reward callable: score it here, on the decoding thread
                        scoring = Future()
                        scoring.set_result(self.data.reward(images, prompts, metadata, references))
            except RewardError as err:
                scoring = Future()
                scoring.set_exception(err)
                decoded = None
            except BaseException as exc:  # noqa: BLE001
                outer.set_exception(exc)
                return
            scoring.add_done_callback(lambda done: settle(decoded, done))

        executor.submit(decode_and_score)
        return outer

    def close(self) -> None:
        """Stop the background threads (after what was submitted), the reward's included."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        close = getattr(self.data.reward, "close", None)
        if callable(close):
            close()
