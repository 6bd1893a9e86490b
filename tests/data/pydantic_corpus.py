"""Pydantic models as users write them, for structured output (issue 32 item 7): constrained strings
(EmailStr when email-validator is installed, constr, pattern), dates, datetimes, times, UUIDs, URLs, IP
addresses, enums, Literal, nested Optionals, bounded lists, dicts with a bounded number of keys, and
discriminated unions. `corpus()` lists (name, model, pydantic_exact): ``pydantic_exact`` is False where the
model checks more than its JSON Schema says (an HttpUrl's scheme http/https, pydantic's URL parser), so an
output valid under the schema may still fail the model's own validation. Emails are exact: the grammar's
email format is a subset of what email-validator accepts (but for its special-use domains such as
``.test``, which a schema cannot name)."""
from __future__ import annotations

import datetime
import enum
import ipaddress
import uuid
from typing import Annotated, Literal, Optional, Union

from pydantic import AnyUrl, BaseModel, ConfigDict, Field, HttpUrl, conint, conlist, constr

try:
    import email_validator  # noqa: F401
    from pydantic import EmailStr
except ImportError:             # pydantic's EmailStr needs it; the schema is the same format either way
    EmailStr = None

Email = EmailStr if EmailStr is not None else Annotated[str, Field(json_schema_extra={"format": "email"})]


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Priority(enum.IntEnum):
    low = 1
    mid = 2
    high = 3


class User(BaseModel):
    name: constr(min_length=1, max_length=20)
    email: Annotated[Email, Field(max_length=40)]
    age: conint(ge=0, le=130)


class Event(BaseModel):
    title: Annotated[str, Field(max_length=30)]
    day: datetime.date
    starts: datetime.datetime
    at: Optional[datetime.time] = None


class Ticket(BaseModel):
    id: uuid.UUID
    code: constr(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    priority: Priority
    color: Color = Color.red


class Link(BaseModel):
    url: HttpUrl
    label: Optional[constr(max_length=16)] = None


class AnyLink(BaseModel):
    url: AnyUrl
    mirrors: conlist(AnyUrl, max_length=2) = []


class Host(BaseModel):
    address: ipaddress.IPv4Address
    v6: Optional[ipaddress.IPv6Address] = None
    name: Annotated[str, Field(json_schema_extra={"format": "hostname"}, max_length=40)]


class Tags(BaseModel):
    tags: conlist(constr(min_length=1, max_length=8), min_length=1, max_length=4)
    counts: dict[str, int] = Field(max_length=3)


class Settings(BaseModel):
    options: dict[str, bool] = Field(min_length=1, max_length=2)
    mode: Literal["fast", "slow"] = "fast"


class Address(BaseModel):
    street: constr(max_length=30)
    city: str
    zip: constr(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str
    home: Optional[Address] = None
    work: Optional[Address] = None
    nickname: Optional[Optional[str]] = None


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: conint(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Bird(BaseModel):
    kind: Literal["bird"]
    wingspan_cm: conint(ge=1, le=300)


class Pet(BaseModel):
    pet: Annotated[Union[Cat, Dog, Bird], Field(discriminator="kind")]
    owner_email: Optional[Annotated[Email, Field(max_length=30)]] = None


class Order(BaseModel):
    order_id: uuid.UUID
    placed: datetime.datetime
    items: conlist(Annotated[str, Field(min_length=2, max_length=12)], min_length=1, max_length=3)
    notes: Optional[constr(max_length=50)] = None
    status: Literal["new", "paid", "shipped"]


class Contact(BaseModel):
    emails: conlist(Annotated[Email, Field(max_length=32)], max_length=2)
    phone: constr(pattern=r"^\+?[0-9]{7,12}$", max_length=13)
    website: Optional[AnyUrl] = None


class Versioned(BaseModel):
    version: constr(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$", max_length=12)
    released: datetime.date
    sha: constr(pattern=r"^[0-9a-f]+$", min_length=7, max_length=12)


class Meeting(BaseModel):
    topic: constr(min_length=3, max_length=40)
    when: datetime.datetime
    duration_min: conint(gt=0, le=480)
    attendees: conlist(Annotated[Email, Field(max_length=40)], min_length=1, max_length=3)


class Labels(BaseModel):
    labels: dict[constr(pattern=r"^[a-z]+$"), str] = Field(max_length=2)


class Metadata(BaseModel):
    extra: dict[str, Union[int, str]] = Field(default_factory=dict, max_length=4)
    created: datetime.datetime


class Shape(BaseModel):
    kind: Literal["circle", "square"]
    size: Annotated[float, Field(ge=0, le=100)]


class Canvas(BaseModel):
    shapes: conlist(Shape, max_length=3)
    background: Color


class Tree(BaseModel):
    value: int
    children: list["Tree"] = Field(default_factory=list, max_length=2)


class Profile(BaseModel):
    id: uuid.UUID
    user: User
    homepage: Optional[HttpUrl] = None
    last_seen: Optional[datetime.datetime] = None


class Sensor(BaseModel):
    ip: ipaddress.IPv4Address
    reading: float
    unit: Literal["C", "F"]
    taken: datetime.datetime


class Answer(BaseModel):
    answer: Literal["yes", "no", "unsure"]
    confidence: Annotated[int, Field(ge=0, le=100)]
    reason: constr(max_length=60)


class IdCard(BaseModel):
    id: Annotated[uuid.UUID, Field(description="a uuid")]
    short: constr(pattern=r"^[a-f0-9]{8}$", min_length=8, max_length=8)
    issued: datetime.date
    expires: Optional[datetime.date] = None


class Weekday(str, enum.Enum):
    mon = "mon"
    tue = "tue"
    wed = "wed"


class Schedule(BaseModel):
    days: conlist(Weekday, min_length=1, max_length=3)
    start: datetime.time
    notes: dict[str, constr(max_length=10)] = Field(max_length=2)


class Quorum(BaseModel):
    votes: dict[str, int] = Field(min_length=2, max_length=5)    # two or more distinct additional keys


class Glossary(BaseModel):
    terms: dict[constr(pattern=r"^[a-z]+$"), constr(max_length=12)] = Field(min_length=3)


class Ballot(BaseModel):
    """Listed properties and typed extras (``__pydantic_extra__``) with a member count needing two or more
    extras beside the required one."""
    model_config = ConfigDict(extra="allow", json_schema_extra={"minProperties": 4, "maxProperties": 6})
    __pydantic_extra__: dict[str, int] = Field(init=False)
    chair: str
    note: Optional[str] = None


def corpus() -> list[tuple[str, type[BaseModel], bool]]:
    exact = {"Link": False, "Profile": False,          # HttpUrl: the model also checks the scheme
             "AnyLink": False}                          # pydantic's URL parser: hosts, ports, escapes
    models = [User, Event, Ticket, Link, AnyLink, Host, Tags, Settings, Address, Person, Pet, Order, Contact,
              Versioned, Meeting, Labels, Metadata, Canvas, Tree, Profile, Sensor, Answer, IdCard, Schedule,
              Quorum, Glossary, Ballot]
    return [(m.__name__, m, exact.get(m.__name__, True)) for m in models]
