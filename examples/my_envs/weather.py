"""weather: an environment with a tool. The model is asked for a city's weather, may call the
`weather` tool (Hermes tool-call format) and reads its answer back; its first turn without a tool
call ends the episode, rewarded 1 when it names that weather."""

import itertools
import random

from fleetrl.envs.base import Task
from fleetrl.envs.tools import Tool

WEATHER = {"Oslo": "snow", "Lima": "fog", "Cairo": "sun", "Hanoi": "rain"}


def lookup(city: str) -> str:
    return WEATHER.get(city, f"error: no weather for {city!r}")


WEATHER_TOOL = Tool(name="weather", fn=lookup, description="Today's weather in a city.",
                    parameters={"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]},
                    timeout_s=5.0)

SYSTEM = ('To learn the weather, reply with only <tool_call>{"name": "weather", "arguments": {"city": "..."}}'
          "</tool_call> and you will get it. Then answer in one word.")


class Weather:
    name = "weather"
    tools = [WEATHER_TOOL]

    def tasks(self, seed):
        rng = random.Random(seed)
        for i in itertools.count():
            city = rng.choice(list(WEATHER))
            yield Task(id=f"{seed}-{i}", answer=WEATHER[city],
                       messages=[{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"What is the weather in {city} today?"}])

    def respond(self, task, messages, state):
        return None  # a turn without a tool call is the final answer

    def reward(self, rollout):
        return float(rollout.task.answer in rollout.completion.lower())
